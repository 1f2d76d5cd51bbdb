"""`python -m engine.analysis.compare`: auto against manual on the same model, data, seed and
mesh, against the single-device reference.

  __main__.py    the command: flags, the run, the report's path
  comparison.py  the measurement: numerics step by step, speed, memory, bytes against the theory
  report.py      the comparison as Markdown, JSON and PNG plots in its workdir
"""
