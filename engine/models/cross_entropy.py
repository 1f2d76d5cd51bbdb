"""Next-token cross-entropy whose backward pass keeps nothing of the size of the logits but
the logits themselves.

Differentiated as written, a float32 log-softmax keeps float32 copies of the [B, L, V] logits
for the backward pass and makes a float32 gradient of that size: at a 50,304-word vocabulary
and 16 x 1024 tokens, 3.3 GB each, more than a 124M-parameter model's weights and AdamW state
together. Here the forward pass computes each position's log-sum-exp and target logit in
float32 inside the fusions that read the logits, and keeps the logits (in their own dtype) and
the log-sum-exp; the backward pass makes the logits' gradient, softmax minus one-hot, in one
pass in the logits' dtype.

The models' heads emit the logits in the compute dtype: the product accumulates in float32 and
rounds once (to bfloat16's 8 bits: 0.4 % of a logit), and everything after it here is float32.
With bfloat16 logits the loss's largest buffer is then the logits' own 1.65 GB at that size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_losses(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
  """-log softmax(logits)[target] for each position, in float32 [B, L]."""
  return _forward(logits_BLV, targets_BL)[0]


def _forward(logits_BLV, targets_BL):
  # Every pass over the logits is a reduction that converts them as it reads them; the
  # target's logit too (a masked sum, where a gather would need a float32 copy to read).
  logits_BLV32 = logits_BLV.astype(jnp.float32)
  lse_BL = jax.nn.logsumexp(logits_BLV32, axis=-1)
  target_BL = jnp.where(_is_target(logits_BLV, targets_BL), logits_BLV32, 0.0).sum(-1)
  return lse_BL - target_BL, (logits_BLV, targets_BL, lse_BL)


def _backward(residuals, g_BL):
  logits_BLV, targets_BL, lse_BL = residuals
  probs_BLV = jnp.exp(logits_BLV.astype(jnp.float32) - lse_BL[..., None])
  one_hot_BLV = _is_target(logits_BLV, targets_BL).astype(jnp.float32)
  return ((probs_BLV - one_hot_BLV) * g_BL[..., None]).astype(logits_BLV.dtype), None


def _is_target(logits_BLV, targets_BL):
  """The one-hot of the targets as a comparison with an iota: computed where it is read (a
  target outside [0, V) matches no word)."""
  words_BLV = jax.lax.broadcasted_iota(targets_BL.dtype, logits_BLV.shape, logits_BLV.ndim - 1)
  return words_BLV == targets_BL[..., None]


token_losses.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sharded_token_losses(logits_BLV: jax.Array, local_targets_BL: jax.Array,
                         axes: tuple[str, ...]) -> jax.Array:
  """token_losses of logits split by vocabulary over the mesh `axes` (inside shard_map): each
  device holds a slice of the words, `local_targets_BL` the targets' indices within it (those
  outside it never match); the losses [B, L] are the same on every device of `axes`."""
  return _sharded_forward(logits_BLV, local_targets_BL, axes)[0]


def _sharded_forward(logits_BLV, local_targets_BL, axes):
  logits_BLV32 = logits_BLV.astype(jnp.float32)
  # The max only stabilises the exponentials; it needs no gradient.
  max_BL = jax.lax.pmax(logits_BLV32.max(-1), axes)
  sum_exp_BL = jax.lax.psum(jnp.exp(logits_BLV32 - max_BL[..., None]).sum(-1), axes)
  lse_BL = jnp.log(sum_exp_BL) + max_BL
  target_BL = jax.lax.psum(
      jnp.where(_is_target(logits_BLV, local_targets_BL), logits_BLV32, 0.0).sum(-1), axes)
  return lse_BL - target_BL, (logits_BLV, local_targets_BL, lse_BL)


def _sharded_backward(axes, residuals, g_BL):
  del axes  # Each device's slice of the gradient needs only its own logits and lse.
  return _backward(residuals, g_BL)


sharded_token_losses.defvjp(_sharded_forward, _sharded_backward)
