"""A run's checkpoint written as a Hugging Face checkpoint (command: python -m engine.export).

  __main__.py  the command line
  exporter.py  the run restored, checked against the family's format, written atomically
"""
