"""Text generation from a run's checkpoint (command: python -m engine.generate).

  __main__.py  the command line
  sampling.py  the key/value cache, prefill and decode steps, sampling; used by the training
               loop's samples too
"""
