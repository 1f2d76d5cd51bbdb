"""The cross-entropy with its own backward pass (engine/models/cross_entropy.py) against NumPy:
losses and the logits' gradient, float32 and bfloat16, whole and split by vocabulary over a
mesh axis in shard_map. (The memory it saves shows in a whole step compiled for a TPU:
docs/benchmarks.md; a head and loss compiled alone fuse either way.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from engine.models.cross_entropy import sharded_token_losses, token_losses

B, L, V = 2, 3, 16


def _numpy(logits, targets, weights):
  """(per-position losses, gradient of sum(weights * losses)) in float64."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  losses = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  grad = np.exp(log_probs) - np.eye(V)[targets]
  return losses, grad * weights[..., None]


def _inputs(dtype):
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(0, 4, (B, L, V)), dtype)
  return logits, rng.integers(0, V, (B, L)), rng.normal(size=(B, L)).astype(np.float32)


@pytest.mark.parametrize('dtype, tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_losses_and_gradient_match_numpy(dtype, tol):
  logits, targets, weights = _inputs(dtype)
  losses, grad = jax.value_and_grad(lambda x: (token_losses(x, targets) * weights).sum())(logits)
  want_losses, want_grad = _numpy(logits.astype(jnp.float32), targets, weights)
  assert grad.dtype == dtype  # The gradient in the logits' own dtype.
  np.testing.assert_allclose(losses, (want_losses * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad, np.float32), want_grad, atol=tol)
  np.testing.assert_allclose(token_losses(logits, targets), want_losses, rtol=1e-5)


def test_split_by_vocabulary_matches_numpy():
  """Four devices of 4 words each: the same losses on every device, each device's slice of the
  gradient."""
  logits, targets, weights = _inputs(jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:4]), ('tensor',))

  def local(logits_BLv, targets_BL, weights_BL):
    first = jax.lax.axis_index('tensor') * logits_BLv.shape[-1]
    total = lambda x: (sharded_token_losses(x, targets_BL - first, ('tensor',)) * weights_BL).sum()
    return jax.value_and_grad(total)(logits_BLv)

  loss, grad = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(None, None, 'tensor'), P(), P()),
                                     out_specs=(P(), P(None, None, 'tensor'))))(
                                         logits, targets, weights)
  want_losses, want_grad = _numpy(logits, targets, weights)
  np.testing.assert_allclose(loss, (want_losses * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, atol=1e-5)
