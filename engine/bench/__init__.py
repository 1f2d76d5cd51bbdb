"""Speed of training-step variants, side by side in one process (command: python -m engine.bench).

  __main__.py        the command line and the report
  calibration.py     the FLOP/s a plain matmul reaches on every device at once
  baseline.py        another checkout's variants in the same interleaved rounds
  baseline_child.py  that checkout's side, a child process run by its path (not imported)
  op_profile.py      each variant's self time per step by op, read from its trace
  grouped_matmul.py  a grouped matmul's time with part of its rows in groups (its own command)
  host_link.py       the link to host memory, as an offloaded optimizer state uses it (its own
                     command)
  loop_cost.py       the training loop's own cost per step against its compiled step alone
                     (its own command)
  timing.py          the median time of a jitted call, for those two
"""
