"""Golden record of the default experiment's first steps: any change to the model, its
initialisation, the optimizer, the schedule or the data pipeline moves one of these numbers.

The experiment is experiments/tiny.py (the README's default job) as is, except for its data
source: the embedded corpus is the running Python's own standard library, which changes between
patch releases, so the record uses the seeded synthetic text instead. Auto mode, 8-way data
parallel (the experiment's mesh on the 8 test devices).

If this fails after a change, decide whether the change was meant to alter the numbers. Update the
record only if the change is intended, and say so in the commit.
"""

import jax
import numpy as np
import pytest

from engine import data, parallel
from engine.assemble import assemble
from experiments import tiny

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

# Measured on 2026-11-30 with jax 0.10.2 on CPU (see BUILD.md for the tested versions).
GOLDEN = {
    'step 1 loss': 5.500516891479492,
    'step 1 grad norm': 2.863245964050293,
    'step 2 loss': 5.514835834503174,
    'step 2 grad norm': 2.873664617538452,
    'sum |initial params|': 3201.4056146475914,
    # The warmup starts at a learning rate of 0, so step 2 makes the first real update.
    'sum |update of steps 1-2|': 9.441833859081527,
}
RTOL = 1e-5  # Float32 results of another XLA version or CPU may move in the last bits.


def _first_steps():
  config = tiny.get_config()
  config.data.source = 'synthetic'
  run = assemble(config)
  corpus, train_setup = run.corpus, run.setup
  steps = parallel.build_steps(config.parallelism.mode, train_setup)
  state, _ = train_setup.init(config.seed)
  initial = [np.asarray(x, np.float64) for x in jax.tree.leaves(state['params'])]
  batches = data.train_iterator(corpus, config.data, config.seed)
  record = {'sum |initial params|': sum(np.abs(p).sum() for p in initial)}
  for step in (1, 2):
    batch = data.to_global(next(batches), train_setup.batch_sharding(),
                           config.data.global_batch_size)
    state, metrics = steps.train(state, batch)
    record[f'step {step} loss'] = float(metrics['loss'])
    record[f'step {step} grad norm'] = float(metrics['grad_norm'])
  final = [np.asarray(x, np.float64) for x in jax.tree.leaves(state['params'])]
  record['sum |update of steps 1-2|'] = sum(np.abs(a - b).sum() for a, b in zip(final, initial))
  return record


def test_first_steps_of_the_default_experiment_match_the_golden_record():
  record = _first_steps()
  changed = {k: (record[k], v) for k, v in GOLDEN.items()
             if record[k] != pytest.approx(v, rel=RTOL)}
  assert not changed, (
      'The default experiment\'s first steps changed (measured, golden): '
      f'{changed}. Update GOLDEN in tests/runs/test_golden.py only if the change is intended.')
