"""The few operations through which a model meets the parallel layout: their plain versions.

A model is written once and calls these where a layout may need communication: constraining an
activation's sharding, applying one stacked layer, finishing a contraction over a sharded
dimension, looking up embeddings. `LocalOps` is the plain single-device computation that every
parallel mode must reproduce; the auto (jit) and manual (shard_map) versions subclass it beside
their step builders in engine.parallel, so a model imports nothing but this file.

Parameters are read the ordinary Flax way (`self.w[...]`, or a standard layer such as
`nnx.Linear` reading its own kernel): the engine prepares every parameter before the model runs
(`prepare_params`), and each stacked layer's parameters inside `layer`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.attention.causal import causal_attention
from engine.models.attention.spec import AttentionSpec
from engine.models.cross_entropy import token_losses
from engine.models.moe import dispatch as moe_dispatch
from engine.models.layers import LAYERS, layer_group, num_groups  # noqa: F401 (LAYERS: re-export)


class LocalOps:
  """No layout: the reference computation."""

  # Packed documents (engine/models/documents.py): (segment ids, positions within the
  # document) of the tokens the model holds, each [B, L]; None: every row is one sequence.
  documents: tuple[jax.Array, jax.Array] | None = None
  # The grouped matmul of a mixture of experts' dropless dispatch (moe_dispatch.ExpertFFN).
  ragged_dot: Callable = staticmethod(jax.lax.ragged_dot)

  def with_documents(self, segments_BL: jax.Array, positions_BL: jax.Array) -> 'LocalOps':
    """A copy of these ops for one batch of packed documents: `positions` returns theirs and
    `attention` never crosses them."""
    ops = copy.copy(self)
    ops.documents = (segments_BL, positions_BL)
    return ops

  def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Names the dimensions of an activation (a layout may constrain its sharding)."""
    del logical_axes
    return x

  def layer(self, fn: Callable) -> Callable:
    """Wraps `fn(layer_module, *args)`, which applies one stacked layer, so that a layout can
    prepare that layer's parameters (FSDP gathers them) and rematerialise it."""
    return fn

  def stack(self, run: Callable, layers: nnx.Module, x: jax.Array) -> jax.Array:
    """Applies the stacked `layers` to `x` with `run(layers, x, documents)` (engine.models.layers'
    apply_layers calls this; `documents`: self.documents for the rows of x): a layout that
    splits the stack into pipeline stages schedules it over micro-batches. A grouped stack
    (engine.models.layers.group_layers) runs group by group, the same layers in the same
    order."""
    groups = num_groups(layers)
    if groups == 1:
      return run(layers, x, self.documents)
    for index in range(groups):
      x = run(layer_group(layers, index), x, self.documents)
    return x

  def column_parallel_input(self, x: jax.Array, logical: str) -> jax.Array:
    """Marks `x` as the input of several column-parallel matmuls whose outputs carry the logical
    dimension `logical` (separate query / key / value projections, an MLP's gate and up): a
    layout that splits that dimension can then sum their input gradients once."""
    del logical
    return x

  def finish_contraction(self, y: jax.Array, contracted: str) -> jax.Array:
    """Called after a matmul that summed over the logical dimension `contracted` (a layout that
    splits that dimension adds up the partial sums here)."""
    del contracted
    return y

  def kv_for_query_heads(self, kv_BLNK: jax.Array, num_heads: int) -> jax.Array:
    """Grouped-query attention: the key (or value) heads that this layout's query heads read,
    [B, L, n, K], for `attention` to group the query heads over (query head h of `num_heads`
    reads key / value head h // (num_heads / N)). A layout that splits the query heads keeps
    only its own; the plain computation keeps all N."""
    del num_heads
    return kv_BLNK

  def inputs_and_targets(self, tokens_BL1: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The tokens the model reads and the next tokens it predicts, from [batch, length + 1]
    (a layout that splits the sequence keeps only this device's positions)."""
    return tokens_BL1[:, :-1], tokens_BL1[:, 1:]

  def positions(self, length: int) -> jax.Array:
    """The position in the whole sequence of each of the `length` tokens the model holds ([L]),
    or with packed documents in its document ([B, L])."""
    if self.documents is not None:
      return self.documents[1]
    return jnp.arange(length)

  def attention(self, q_BLHK, k_BLnK, v_BLnK, spec: AttentionSpec) -> jax.Array:
    """Causal self-attention over the whole sequence as `spec` says
    (engine/models/attention/spec.py); keys and values of n heads, n dividing the query heads
    (kv_for_query_heads). A layout that splits the sequence passes keys and values between its
    devices. With packed documents, only keys of the query's own document."""
    return causal_attention(q_BLHK, k_BLnK, v_BLnK, spec, self.segments())

  def segments(self) -> jax.Array | None:
    """The segment ids [B, L] of the tokens the model holds (packed documents), or None."""
    return None if self.documents is None else self.documents[0]

  def batch_mean(self, x: jax.Array) -> jax.Array:
    """A statistic that is a mean over the tokens this device holds (a mixture of experts'
    routing fractions), as the mean over the whole batch: a layout that splits the tokens
    averages it over its devices (which hold equal token counts)."""
    return x

  def experts(self, x_BLD: jax.Array, experts_BLK: jax.Array, ffn: moe_dispatch.ExpertFFN,
              num_experts: int, slots: int | None) -> tuple[jax.Array, jax.Array]:
    """A mixture of experts' dispatch (engine/models/moe/dispatch.py): ([B, L, K, D] the output
    of each token's K chosen experts, zero where dropped; the fraction dropped). `slots`: the
    capacity per expert and sequence, or None for the dropless dispatch. A layout that splits
    the experts over devices moves the tokens to them and back."""
    if slots is not None:
      return moe_dispatch.with_capacity(x_BLD, experts_BLK, ffn, num_experts, slots)
    B, L, K = experts_BLK.shape
    y_TKD = moe_dispatch.dropless(x_BLD.reshape(B * L, -1), experts_BLK.reshape(B * L, K), ffn)
    return y_TKD.reshape(B, L, K, -1), jnp.zeros((), jnp.float32)

  def latent_history(self, latent_BLC: jax.Array, key_rope_BLR: jax.Array):
    """Latent attention's keys and values so far, as (normalised latents [B, S, C], rotary keys
    [B, S, R]) over the S positions this step's queries may see: in training this sequence's own
    (S = L); generation's layout returns its cache's slots after writing these to it."""
    return latent_BLC, key_rope_BLR

  def embed_lookup(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    return jnp.take(table_VD, tokens_BL, axis=0)

  def for_chunked_loss(self) -> 'LocalOps':
    """These ops for a loss that calls `chunk_loss_sum` and nothing else on the head (a layout
    may then lay the head out for it)."""
    return self

  def chunk_loss_sum(self, head_logits: Callable, x_BlD: jax.Array, targets_Bl: jax.Array,
                     keep_Bl: jax.Array) -> jax.Array:
    """The kept losses' sum over one chunk of the positions (engine/models/chunked_loss.py)."""
    return self.cross_entropy(head_logits(x_BlD), targets_Bl, keep_Bl, 1.0)

  def cross_entropy(self, logits_BLV: jax.Array, targets_BL: jax.Array,
                    keep_BL: jax.Array | None = None, count=None) -> jax.Array:
    """Mean next-token cross-entropy in float32 (engine/models/cross_entropy.py); with
    `keep_BL` (packed documents), the sum over the kept predictions divided by `count`
    (reduce_losses)."""
    return reduce_losses(token_losses(logits_BLV, targets_BL), keep_BL, count)

  def prepare_params(self, module: nnx.Module, skip_stacked: bool = True) -> nnx.Module:
    """Called by the engine, not the model: the module with its parameters ready for computation
    (those stacked along LAYERS are left to `layer` when `skip_stacked`). Plain computation
    needs nothing."""
    del skip_stacked
    return module


def reduce_losses(losses_BL: jax.Array, keep_BL: jax.Array | None, count) -> jax.Array:
  """The mean of the per-token losses; or, with `keep_BL`, the kept ones' sum / `count`: the
  step passes the global batch's kept count per device and micro-batch, so that averaging
  over those gives the global sum over the global count (not a mean of unequal means)."""
  if keep_BL is None:
    return losses_BL.mean()
  return jnp.where(keep_BL, losses_BL, 0.0).sum() / count
