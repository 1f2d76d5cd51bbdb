"""Text generation from a run's checkpoint (command: python -m engine.generate).

  __main__.py  the command line
  sampling.py  the key/value cache's size, prompts, sampling, and the Generator that drives
               the prefill and decode steps (engine/parallel/decode.py); used by the training
               loop's samples too
"""
