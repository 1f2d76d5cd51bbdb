"""Several processes as one run.

  startup.py    jax.distributed started from flags or the environment; a failure stops all
  roll_call.py  every process reports before the first collective, so a missing one is named
"""
