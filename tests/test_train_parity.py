"""The whole training loop (data pipeline, global batch assembly, steps) in each mode reproduces
the single-device computation. Per-mesh parity of the steps themselves is in
test_manual_parity.py; here the full `train()` runs on a 2x2x2 mesh.

Tolerance as in test_manual_parity.py: a few float32 ulps per step, far below a layout bug.
"""

import numpy as np
import pytest

from engine.train import train
from tests.helpers import single_device_run, tiny_config

STEPS = 4


@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_train_matches_single_device(mode, tmp_path):
  reference, _ = single_device_run(tiny_config(), STEPS)
  config = tiny_config(mesh=(2, 2, 2), steps=STEPS)
  config.parallelism.mode = mode
  result = train(config, str(tmp_path))
  losses = np.array([result.train_losses[s] for s in range(1, STEPS + 1)])
  np.testing.assert_allclose(losses, reference, atol=1e-5, rtol=0)
  assert abs(losses[-1] - losses[0]) > 1e-3
