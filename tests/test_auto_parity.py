"""Auto mode on 8 devices trains exactly like the single-device computation.

Tolerance: the sharded runs sum the same float32 numbers in a different order (partial sums per
shard, then all-reduces), which moves a loss of ~3.5 by a few ulps per step; 2e-5 absolute is
about 50 ulps and far below any real layout bug (a wrong gradient scale changes the second step's
loss by ~1e-2).
"""

import numpy as np
import pytest

from engine.train import train
from tests.helpers import single_device_run, tiny_config

STEPS = 4
LOSS_ATOL = 2e-5


@pytest.fixture(scope='module')
def reference_losses():
  losses, _ = single_device_run(tiny_config(), STEPS)
  return losses


@pytest.mark.parametrize('mesh', [(8, 1, 1), (1, 8, 1), (2, 2, 2), (4, 1, 2)],
                         ids=lambda m: 'x'.join(map(str, m)))
def test_auto_matches_single_device(mesh, reference_losses, tmp_path):
  result = train(tiny_config(mesh=mesh, steps=STEPS), str(tmp_path))
  losses = np.array([result.train_losses[s] for s in range(1, STEPS + 1)])
  np.testing.assert_allclose(losses, reference_losses, atol=LOSS_ATOL, rtol=0)
  # The parameters moved: the losses after the first step differ from the first.
  assert abs(losses[-1] - losses[0]) > 1e-3
