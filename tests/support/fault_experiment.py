"""The multi-process test experiment with a fault planted in one process's data: after
`hang_after` batches it delivers none (the next step never starts: a hang), or it delivers each
batch `delay_s` late (a straggler). Other arguments are multihost_experiment.py's.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- python -m engine.main \
      --config=tests/support/fault_experiment.py:process=1,delay_s=0.2,steps=40 --workdir=DIR
"""

import itertools
import threading
import time

import jax

from engine.train import loop
from tests.support import multihost_experiment

FAULT_ARGS = {'process': int, 'hang_after': int, 'delay_s': float}


def _planted(global_batches, process: int, hang_after: int, delay_s: float):
  def batches(run, train_iterator):
    source = global_batches(run, train_iterator)
    if jax.process_index() != process:
      yield from source
      return
    for count in itertools.count():
      if hang_after and count == hang_after:
        threading.Event().wait()  # Forever.
      if delay_s:
        time.sleep(delay_s)
      yield next(source)
  return batches


def get_config(arg=None):
  parts = [part for part in (arg or '').split(',') if part]
  fault = {key: FAULT_ARGS[key](value) for key, _, value in
           (part.partition('=') for part in parts) if key in FAULT_ARGS}
  rest = ','.join(part for part in parts if part.partition('=')[0] not in FAULT_ARGS)
  loop.global_batches = _planted(loop.global_batches, fault.get('process', 1),
                                 fault.get('hang_after', 0), fault.get('delay_s', 0.0))
  return multihost_experiment.get_config(rest or None)
