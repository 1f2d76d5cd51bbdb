"""Manual mode's operations: the model's layout hooks (engine/models/ops.py's LocalOps) written
with explicit collectives on local shards, and the casts that keep a replicated parameter's
gradient local until one explicit pmean averages it (engine/parallel/manual.py says where each
collective comes from and why).
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.cross_entropy import sharded_token_losses
from engine.models.moe import dispatch as moe_dispatch
from engine.models.ops import LocalOps, reduce_losses
from engine.parallel import context, expert_exchange, flat_gather, quantized_gather
from engine.parallel.pipeline import gpipe as pipeline
from engine.parallel.steps import REMAT_POLICIES, map_params_together
from engine.sharding import spec_axes
from engine.state import TrainSetup

# The token embedding's and the head's logical axes (ModelSpec.untied_embeddings).
EMBEDDING_AXES = ('vocab', 'embed')
HEAD_AXES = ('embed', 'vocab')
_NOT_KEPT = frozenset({'all_gather', 'split', 'slice', 'squeeze', 'reshape', 'transpose',
                       'convert_element_type'})


class ManualOps(LocalOps):
  """The model's layout hooks, written with explicit collectives on local shards.

  With `gather=False` the parameters arrive already gathered (the micro-batch path of
  `build_steps`), and are only cast to the compute dtype. With `average_in_backward` each
  parameter's gradient is averaged over the batch axes where the backward pass produces it.
  """

  def __init__(self, setup: TrainSetup, gather: bool = True, average_in_backward: bool = False):
    self.rules = setup.rules
    self.ragged_dot = expert_exchange.ragged_dot_for(setup)
    # Context parallelism: the axis that splits every sequence (engine/parallel/context.py).
    context_axes = setup.rules.mesh_axes('length', activation=True)
    self.context_axis = context_axes[0] if context_axes else None
    self.context_size = setup.mesh.shape[self.context_axis] if context_axes else 1
    # Every device along these axes sees different tokens: losses and gradients are averaged
    # over them (the sequence's devices hold equal token counts, so their mean is the mean).
    self.batch_axes = setup.rules.mesh_axes('batch', activation=True) + context_axes
    # Pipeline parallelism: the axis that splits the stacked layers
    # (engine/parallel/pipeline/gpipe.py).
    stage_axes = setup.rules.mesh_axes('layers')
    self.stage_axis = stage_axes[0] if stage_axes else None
    self.stages = setup.mesh.shape[self.stage_axis] if stage_axes else 1
    self.microbatches = setup.options.microbatches
    self.average_in_backward = average_in_backward
    self.mesh_shape = dict(setup.mesh.shape)
    self.compute_dtype = jnp.dtype(setup.options.compute_dtype)
    self.reduce_dtype = jnp.dtype(setup.options.grad_reduce_dtype)
    self.gather_dtype = setup.options.gather_dtype
    self.gather = gather
    # The mesh axes whose devices look tokens up on their own columns of the embedding table
    # (`embed_lookup`); () where it is gathered whole like every other weight.
    self.lookup_axes = columns_lookup_axes(setup) if gather else ()
    # The mesh axes over which a chunked loss splits the head by vocabulary (`for_chunked_loss`).
    self.head_axes = ()
    self.flat_gather = setup.options.flat_gather
    # How the dropless dispatch's blocks travel: only their rows in use where the devices can.
    self.expert_exchange = expert_exchange.exchange_kind(setup)
    keep = REMAT_POLICIES[setup.options.remat] or jax.checkpoint_policies.everything_saveable
    # Neither gathered weights nor the cuts and casts that make them (flat_gather), nor the
    # slices a model takes of them (`w_qkv[c]`), are kept for the backward pass, whatever the
    # policy: peak memory holds one layer's full parameters.
    self.remat_policy = lambda prim, *args, **params: (
        prim.name not in _NOT_KEPT and keep(prim, *args, **params))

  def gathered(self, values: list, logical_axes: list) -> list:
    """The parameters with their FSDP-split dimensions all-gathered, those split alike in one
    all_gather (engine/parallel/flat_gather.py), in the reduction dtype (the gather's transpose,
    a reduce-scatter, then moves the gradient in that dtype); or each in int8 / fp8 with its
    scales (parallelism.gather_dtype: engine/parallel/quantized_gather.py)."""
    splits = [flat_gather.split_dims(self.rules, axes) for axes in logical_axes]
    if self.gather_dtype != 'default':  # 1-byte values on the wire, one weight at a time.
      return [quantized_gather.gather(v, s, self.gather_dtype, self.compute_dtype,
                                      self.reduce_dtype) if s else v
              for v, s in zip(values, splits)]
    values = [v.astype(self.reduce_dtype) if s else v for v, s in zip(values, splits)]
    return flat_gather.gather_together(values, splits, self.flat_gather)

  def scattered(self, grads: list, logical_axes: list) -> list:
    """The transpose of `gathered` for gradients of the whole parameters: each FSDP-split
    dimension summed over its axes and scattered back to this device's shard."""
    splits = [flat_gather.split_dims(self.rules, axes) for axes in logical_axes]
    return flat_gather.scatter_together(grads, splits, self.flat_gather)

  def batch_reduction(self, logical_axes) -> tuple[tuple[str, ...], int]:
    """For a parameter with these (storage) logical axes: the batch axes it is replicated over,
    where its gradient needs a pmean, and the product of the batch axes that split it, whose
    psum_scatter (the transpose of its gather) summed what a mean must divide."""
    return self.spec_reduction(self.rules.spec(logical_axes, activation=False))

  def spec_reduction(self, param_spec) -> tuple[tuple[str, ...], int]:
    """batch_reduction of a parameter stored with this PartitionSpec."""
    stored = spec_axes(param_spec)
    replicated = tuple(a for a in self.batch_axes if a not in stored)
    return replicated, math.prod(self.mesh_shape[a] for a in self.batch_axes if a in stored)

  def _prepared(self, values: list, logical_axes: list) -> list:
    if self.average_in_backward:
      values = [averaged_in_backward(v, *self.batch_reduction(axes), self.reduce_dtype)
                for v, axes in zip(values, logical_axes)]
    # The embedding table stays this device's columns, in its stored dtype (`embed_lookup`);
    # under a chunked loss the head is exchanged to a slice of the vocabulary (`chunk_loss_sum`).
    table = [bool(self.lookup_axes) and tuple(axes) == EMBEDDING_AXES for axes in logical_axes]
    head = [bool(self.head_axes) and tuple(axes) == HEAD_AXES for axes in logical_axes]
    rest = [i for i in range(len(values)) if not (table[i] or head[i])]
    prepared = list(values)
    if self.gather:
      gathered = self.gathered([values[i] for i in rest], [logical_axes[i] for i in rest])
      for i, value in zip(rest, gathered):
        prepared[i] = value
    for i in (i for i, h in enumerate(head) if h):  # [D / n, V] -> [D, V / n], each way.
      # In the compute dtype: the exchange sums nothing, and the gradient it sends back is
      # already in that dtype.
      prepared[i] = jax.lax.all_to_all(values[i].astype(self.compute_dtype), self.head_axes,
                                       split_axis=1, concat_axis=0, tiled=True)
    return [v if t else v.astype(self.compute_dtype) for v, t in zip(prepared, table)]

  def for_chunked_loss(self):
    ops = copy.copy(self)
    ops.head_axes = self.lookup_axes  # The same conditions: an untied head split along embed.
    return ops

  def chunk_loss_sum(self, head_logits, x_BlD, targets_Bl, keep_Bl):
    if not self.head_axes:
      return super().chunk_loss_sum(head_logits, x_BlD, targets_Bl, keep_Bl)
    # The head holds a slice of the vocabulary for every embedding dimension: the group's
    # features of this chunk are gathered (cast to varying over tensor first, so that the
    # backward pass reduce-scatters their gradient before summing it over tensor), each device
    # computes the logits of its slice for all of them, and keeps its own rows' losses. The
    # gather's transpose sums each row's gradient over the slices; the exchange's sends the
    # head's gradient home as the gathered head's reduce-scatter would.
    axes, B = self.head_axes, x_BlD.shape[0]
    x_BlD = self.column_parallel_input(x_BlD, 'vocab')
    group_x_GlD = jax.lax.all_gather(x_BlD, axes, axis=0, tiled=True)
    group_targets_Gl = jax.lax.all_gather(targets_Bl, axes, axis=0, tiled=True)
    losses_Gl = self._vocab_losses(head_logits(group_x_GlD), group_targets_Gl, axes)
    return reduce_losses(self._own_rows(losses_Gl, B), keep_Bl, 1.0)

  def _own_rows(self, group_G_, rows: int):
    """This device's `rows` of rows gathered over the head's axes."""
    return jax.lax.dynamic_slice_in_dim(group_G_, self.shard_index(self.head_axes) * rows, rows,
                                        axis=0)

  def prepare_params(self, module, skip_stacked=True):
    return map_params_together(module, self._prepared, skip_stacked)

  def layer(self, fn):
    def prepared_layer(layer, *args):
      return fn(self.prepare_params(layer, skip_stacked=False), *args)
    return nnx.remat(prepared_layer, policy=self.remat_policy)

  def stack(self, run, layers, x):
    if self.stage_axis is None:
      return super().stack(run, layers, x)
    return pipeline.manual_pipeline(run, layers, x, self.stage_axis, self.stages,
                                    self.microbatches, rows=self.documents)

  def column_parallel_input(self, x, logical):
    # x is whole on every device of these axes. Cast to varying once, so the backward pass adds
    # the gradients of all its consumers locally and psums once, not once per consumer (the
    # implicit cast in each matmul would transpose to a psum each).
    axes = self.rules.mesh_axes(logical, activation=True)
    return jax.lax.pcast(x, axes, to='varying') if axes else x

  def shard_index(self, axes) -> jax.Array:
    """Row-major position of this device among the shards split over `axes`."""
    index = 0
    for axis in axes:
      index = index * self.mesh_shape[axis] + jax.lax.axis_index(axis)
    return index

  def kv_for_query_heads(self, kv_BLNK, num_heads):
    head_axes = self.rules.mesh_axes('heads', activation=True)
    kv_axes = self.rules.mesh_axes('kv_heads', activation=True)
    if kv_axes or not head_axes:
      # Split like the query heads (this device's kv heads serve exactly its query heads), or
      # nothing split: the attention groups the query heads over them as they are.
      assert not kv_axes or kv_axes == head_axes, (kv_axes, head_axes)
      return kv_BLNK
    # Replicated (too few to split) under split query heads: only the kv heads those read.
    group = num_heads // kv_BLNK.shape[2]  # Query heads per kv head.
    local_heads = num_heads // math.prod(self.mesh_shape[a] for a in head_axes)
    first = self.shard_index(head_axes) * local_heads  # This device's first query head.
    if local_heads % group == 0 or group % local_heads == 0:  # Whole groups, or part of one.
      return jax.lax.dynamic_slice_in_dim(kv_BLNK, first // group,
                                          max(local_heads // group, 1), axis=2)
    # Groups straddle devices: one kv head per query head.
    return jax.lax.dynamic_slice_in_dim(jnp.repeat(kv_BLNK, group, axis=2), first,
                                        local_heads, axis=2)

  def finish_contraction(self, y, contracted):
    axes = self.rules.mesh_axes(contracted, activation=True)
    return jax.lax.psum(y, axes) if axes else y

  def _vocab_shard(self, local_vocab: int):
    """(axes, first id of this device's vocabulary shard) for a vocab split over `tensor`."""
    axes = self.rules.mesh_axes('vocab', activation=True)
    return axes, self.shard_index(axes) * local_vocab

  def inputs_and_targets(self, tokens_BL1):
    if self.context_axis is None:
      return super().inputs_and_targets(tokens_BL1)
    return context.local_sequence(tokens_BL1, self.context_axis, self.context_size)

  def positions(self, length):
    if self.context_axis is None or self.documents is not None:
      return super().positions(length)
    return context.local_positions(length, self.context_axis, self.context_size)

  def attention(self, q_BLHK, k_BLnK, v_BLnK, spec):
    if self.context_axis is None:
      return super().attention(q_BLHK, k_BLnK, v_BLnK, spec)
    # Ring attention: validation refuses a window shorter than the sequence.
    return context.ring_attention(q_BLHK, k_BLnK, v_BLnK, spec, self.context_axis,
                                  self.segments())

  def embed_lookup(self, table_VD, tokens_BL):
    if not self.lookup_axes:
      return self._vocab_lookup(table_VD, tokens_BL)
    # The table split along `embed` stays split: every device of the split looks up all their
    # tokens on its own columns, and each gets its tokens' whole rows back in one all_to_all.
    # Its transpose sends the rows' gradients home, so each device's gradient is its columns'
    # sum over the group's tokens, what the gathered table's reduce-scatter would give, and the
    # table's whole gradient is never formed.
    axes = self.lookup_axes
    group_tokens_GL = jax.lax.all_gather(tokens_BL, axes, axis=0, tiled=True)
    columns_GLd = self._vocab_lookup(table_VD, group_tokens_GL).astype(self.compute_dtype)
    return jax.lax.all_to_all(columns_GLd, axes, split_axis=0, concat_axis=2, tiled=True)

  def _vocab_lookup(self, table_VD, tokens_BL):
    """The rows of `tokens_BL` in a table whole along the vocabulary, or split over `tensor`
    (a masked lookup on this device's ids, summed over the split)."""
    axes, first = self._vocab_shard(table_VD.shape[0])
    if not axes:
      return super().embed_lookup(table_VD, tokens_BL)
    local_BL = tokens_BL - first
    mine_BL = (local_BL >= 0) & (local_BL < table_VD.shape[0])
    rows_BLD = jnp.take(table_VD, jnp.where(mine_BL, local_BL, 0), axis=0)
    return jax.lax.psum(jnp.where(mine_BL[..., None], rows_BLD, 0), axes)

  def experts(self, x_BLD, experts_BLK, ffn, num_experts, slots):
    axes = self.rules.mesh_axes('experts', activation=True)
    if not axes:  # Every device holds every expert.
      return super().experts(x_BLD, experts_BLK, ffn, num_experts, slots)
    axis = axes[0]
    if slots is not None:
      return moe_dispatch.with_capacity(x_BLD, experts_BLK, ffn, num_experts, slots,
                                        expert_exchange.capacity_exchange(axis))
    B, L, K = experts_BLK.shape
    y_TKD = expert_exchange.dropless(x_BLD.reshape(B * L, -1), experts_BLK.reshape(B * L, K),
                                     ffn, num_experts, axis, self.mesh_shape[axis],
                                     self.expert_exchange)
    return y_TKD.reshape(B, L, K, -1), jnp.zeros((), jnp.float32)

  def batch_mean(self, x):
    # Every device's loss then holds the same shared term; pmean's transpose gives each device
    # the share of its gradient that the step's average over the batch axes expects.
    return jax.lax.pmean(x, self.batch_axes) if self.batch_axes else x

  def cross_entropy(self, logits_BLV, targets_BL, keep_BL=None, count=None):
    if not self.rules.mesh_axes('vocab', activation=True):
      return super().cross_entropy(logits_BLV, targets_BL, keep_BL, count)
    return reduce_losses(self._vocab_losses(logits_BLV, targets_BL), keep_BL, count)

  def _vocab_losses(self, logits_BLV, targets_BL, more_axes=()):
    """Each position's cross-entropy [B, L] from logits split by vocabulary over tensor, then
    `more_axes` (row-major: this device's slice is its index over them all)."""
    axes = self.rules.mesh_axes('vocab', activation=True) + tuple(more_axes)
    first = self.shard_index(axes) * logits_BLV.shape[-1]
    return sharded_token_losses(logits_BLV, targets_BL - first, axes)


def columns_lookup_axes(setup: TrainSetup) -> tuple[str, ...]:
  """The FSDP axes over which manual mode looks tokens up on each device's columns of the
  embedding table instead of gathering it (ManualOps.embed_lookup): a table only the lookup
  reads, split along `embed` alone, in a step that gathers weights where it uses them (not once
  per step for micro-batches or pipeline stages). () otherwise."""
  if not setup.model.untied_embeddings:
    return ()
  if setup.options.microbatches > 1 or setup.rules.mesh_axes('layers'):
    return ()
  if setup.rules.gather_axes('vocab'):
    return ()
  return tuple(setup.rules.gather_axes('embed'))


def chunked_head_axes(setup: TrainSetup) -> tuple[str, ...]:
  """The axes over which a chunked loss splits the head by vocabulary (`for_chunked_loss`,
  `chunk_loss_sum`): the table's column-lookup axes, under model.loss_chunks > 1."""
  return columns_lookup_axes(setup) if setup.options.loss_chunks > 1 else ()


def averaged_in_backward(param, replicated_axes, scatter_factor, reduce_dtype):
  """`param` as a local copy, varying over `replicated_axes`; the backward pass turns its
  gradient into the batch mean right there (`average_over_batch`)."""
  if not replicated_axes and scatter_factor == 1:
    return param

  @jax.custom_vjp
  def local_copy(p):
    return cast_to_varying(p, replicated_axes)

  def forward(p):
    return local_copy(p), None

  def backward(_, grad):
    return (average_over_batch(grad, replicated_axes, scatter_factor, reduce_dtype)
            .astype(param.dtype),)

  local_copy.defvjp(forward, backward)
  return local_copy(param)


def average_over_batch(grad, replicated_axes, scatter_factor, reduce_dtype=jnp.float32):
  """One explicit pmean (in `reduce_dtype`) over the batch axes the parameter is replicated on;
  gathered batch axes already summed their shards' gradients in the psum_scatter, so divide by
  their size. Returns float32, the parameters' dtype."""
  if replicated_axes:
    grad = jax.lax.pmean(grad.astype(reduce_dtype), replicated_axes)
  grad = grad.astype(jnp.float32)
  return grad / scatter_factor if scatter_factor > 1 else grad


def cast_to_varying(param, axes):
  """A local copy of a parameter replicated over `axes`, so its gradient stays local."""
  return jax.lax.pcast(param, axes, to='varying') if axes else param


def psum_if(x, axes):
  return jax.lax.psum(x, axes) if axes else x
