"""Loss, perplexity and bits per byte of a run's checkpoint (command: python -m engine.evaluate).

  __main__.py  the command line
  scoring.py   held-out or text-file windows scored with the run's model
"""
