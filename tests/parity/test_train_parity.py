"""The whole training loop (data pipeline, global batch assembly, steps) in each mode reproduces
the single-device computation. Per-mesh parity of the steps themselves, gradients included, is in
test_manual_parity.py; here the full `train()` runs on a 2x2x2 mesh and its logged losses and
gradient norms must match (tolerance: tests/support/helpers.py).
"""

import numpy as np
import pytest

from engine.train.loop import train
from tests.support.helpers import ATOL, single_device_run, tiny_config

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

STEPS = 4


@pytest.fixture(scope='module')
def reference():
  return single_device_run(tiny_config(), STEPS)


@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_train_matches_single_device(mode, reference, tmp_path):
  config = tiny_config(mesh=(2, 2, 2), steps=STEPS)
  config.parallelism.mode = mode
  result = train(config, str(tmp_path))
  logged = range(1, STEPS + 1)
  losses = np.array([result.train_losses[s] for s in logged])
  np.testing.assert_allclose(losses, reference.losses, atol=ATOL, rtol=0)
  np.testing.assert_allclose([result.train_grad_norms[s] for s in logged], reference.grad_norms,
                             rtol=ATOL, atol=0)
  assert abs(losses[-1] - losses[0]) > 1e-3
