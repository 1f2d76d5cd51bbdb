"""Sweeps: every combination of a grid of config values trained (command: python -m engine.sweep).

  __main__.py  the command line: its flags, the variants' command lines, the end's summary
  runner.py    one engine.main child per variant, its progress logged, recorded in sweep.json as
               each ends: resumable
  grid.py      the grid parsed into variants, each variant's config and command line
  report.py    the table (best variant marked), CSV, loss curves and final losses per value
"""
