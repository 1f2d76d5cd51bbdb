"""A pod run planned on this machine: the real train step compiled for a TPU topology, never run
(command: python -m engine.plan).

  __main__.py  the command line
  planner.py   candidates compiled, memory against HBM, collectives against theory, a roofline
  search.py    --search: every layout and lever estimated, the fastest that fit compiled
  step_flops.py   the FLOPs a step executes beyond the model's count, and those at int8 / fp8
  peak_memory.py  what a compiled step's memory is made of, from the compiler's own reports
  report.py    the plan as Markdown, with each candidate's training command
"""
