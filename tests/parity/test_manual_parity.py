"""Manual (shard_map) and auto (jit) steps on 8 devices against the single-device computation.

Each layout runs 3 optimizer steps from the same initial state on the same batches as the
single-device reference (engine.analysis.reference), and must match it on every step's loss and
gradient norm, every parameter's gradient at step 1, and every parameter after step 3
(tolerance and why: tests/support/helpers.py). Gradients are compared, not only losses and
parameters, because Adam divides the update by the gradient's own scale: a gradient summed
instead of averaged over the batch shards (8x too large) moves the parameters almost exactly like
the right one.
`test_a_summed_gradient_fails_the_check` shows that the check catches that bug.
"""

import jax
import numpy as np
import pytest

from engine.parallel import manual_ops
from tests.support.helpers import assert_same_run, engine_run, single_device_run, tiny_config

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

STEPS = 3
MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2), (2, 4, 1), (1, 2, 4)]


def _config(mesh=(1, 1, 1)):
  config = tiny_config(mesh=mesh, steps=STEPS)
  config.model.num_heads = 8  # So that tensor=8 splits the heads too.
  return config


@pytest.fixture(scope='module')
def reference():
  run = single_device_run(_config(), STEPS)
  initial = single_device_run(_config(), 0).params
  # The parameters really moved, so agreeing with them is not trivial.
  assert max(np.abs(run.params[p] - initial[p]).max() for p in initial) > 1e-3
  return run


@pytest.mark.parametrize('mode', ['manual', 'auto'])
@pytest.mark.parametrize('mesh', MESHES, ids=lambda m: 'x'.join(map(str, m)))
def test_matches_single_device(mesh, mode, reference):
  assert_same_run(engine_run(_config(mesh), mode, STEPS), reference)


@pytest.mark.parametrize('mesh', [(1, 8, 1), (2, 2, 2)], ids=['1x8x1', '2x2x2'])
def test_fsdp_gathers_one_weight_at_a_time_match_too(mesh, reference):
  """parallelism.fsdp_gather=per_weight (what GPU and TPU get by default; CPU devices gather
  each layer's weights together): the same numbers."""
  config = _config(mesh)
  config.parallelism.fsdp_gather = 'per_weight'
  assert_same_run(engine_run(config, 'manual', STEPS), reference)


def test_a_summed_gradient_fails_the_check(reference, monkeypatch):
  def summed(grad, replicated_axes, *_):  # The bug: psum where pmean belongs.
    return jax.lax.psum(grad, replicated_axes) if replicated_axes else grad

  monkeypatch.setattr(manual_ops, 'average_over_batch', summed)
  run = engine_run(_config((8, 1, 1)), 'manual', STEPS)
  # The loss of step 1 precedes any update, so it still agrees; the gradients do not.
  np.testing.assert_allclose(run.losses[0], reference.losses[0], atol=1e-5)
  np.testing.assert_allclose(run.grad_norms[0], 8 * reference.grad_norms[0], rtol=1e-5)
  with pytest.raises(AssertionError):
    assert_same_run(run, reference)
