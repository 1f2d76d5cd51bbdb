"""Manual mode: the whole train step inside `jax.shard_map`, every collective written here.

The collectives come from the same rules that give auto mode its shardings:

- A parameter dimension whose logical name maps to mesh axes in the parameter rules but not in
  the activation rules (FSDP's `embed` -> fsdp) is `all_gather`ed before use, the weights split
  alike in one collective (engine/parallel/flat_gather.py): a stacked layer's when that layer
  starts (`ops.layer`, in the layer scan and under remat: one layer's gathered weights alive at a
  time, gathered again in the backward pass), the others once before the model runs. The
  gather's transpose, a `psum_scatter`, reduce-scatters the gradients. The model reads
  parameters the plain Flax way.
- A contraction over a dimension that the activation rules shard (Megatron's row-parallel
  attention-out and MLP-down over `heads` / `mlp` -> tensor) ends with a `psum` over those axes.
  Its column-parallel partner needs nothing in the forward pass; JAX's varying-axes types turn the
  broadcast of the replicated activation into the backward `psum`.
- A vocabulary sharded over `tensor` gets a vocab-parallel embedding lookup (masked local lookup,
  `psum`) and a vocab-parallel cross-entropy (`pmax` / `psum` of the logsumexp terms).
- A sequence split over `context` (activations' `length`): each device keeps two chunks of every
  sequence and attention passes keys and values around the ring with `ppermute`
  (engine/parallel/context.py); the context axis counts as a batch axis for the averages below.
- Stacked layers split over `stage` run as a GPipe pipeline (engine/parallel/pipeline.py): the
  micro-batches' activations move to the next stage with `ppermute`, and gradients are
  synchronised once after the backward pass (the pipeline runs each layer several times).
- Gradients avoid a trap of shard_map: taken with respect to a parameter replicated over a batch
  axis, a gradient comes back already summed over it (the broadcast's transpose is a psum: N
  times too large, docs/collectives.md). So each parameter is cast to
  varying over the batch axes it is replicated on, the gradient is taken with respect to that
  local copy, and one explicit `pmean` over those axes averages it. Where the cast happens
  decides when: with one micro-batch it is part of preparing the parameter for use (inside the
  layer scan for stacked layers), so the backward pass averages each layer's gradients as soon
  as they are produced and the reduction overlaps the layers still to go, as the compiler
  schedules it in auto mode. With several micro-batches the cast is made once, outside the
  accumulation loop, so that each gradient is still averaged only once per step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine.models import moe_dispatch
from engine.models.ops import LocalOps, reduce_losses
from engine.parallel import context, expert_exchange, flat_gather, pipeline
from engine.parallel.steps import (REMAT_POLICIES, Steps, accumulate_gradients, apply_update,
                                   kept_count, map_params, map_params_together, next_token_loss,
                                   window_losses)
from engine.sharding import named, spec_axes
from engine.state import TrainSetup

_NOT_KEPT = frozenset({'all_gather', 'split', 'reshape', 'transpose', 'convert_element_type'})


class ManualOps(LocalOps):
  """The model's layout hooks, written with explicit collectives on local shards.

  With `gather=False` the parameters arrive already gathered (the micro-batch path of
  `build_steps`), and are only cast to the compute dtype. With `average_in_backward` each
  parameter's gradient is averaged over the batch axes where the backward pass produces it.
  """

  def __init__(self, setup: TrainSetup, gather: bool = True, average_in_backward: bool = False):
    self.rules = setup.rules
    # Context parallelism: the axis that splits every sequence (engine/parallel/context.py).
    context_axes = setup.rules.mesh_axes('length', activation=True)
    self.context_axis = context_axes[0] if context_axes else None
    self.context_size = setup.mesh.shape[self.context_axis] if context_axes else 1
    # Every device along these axes sees different tokens: losses and gradients are averaged
    # over them (the sequence's devices hold equal token counts, so their mean is the mean).
    self.batch_axes = setup.rules.mesh_axes('batch', activation=True) + context_axes
    # Pipeline parallelism: the axis that splits the stacked layers (engine/parallel/pipeline.py).
    stage_axes = setup.rules.mesh_axes('layers')
    self.stage_axis = stage_axes[0] if stage_axes else None
    self.stages = setup.mesh.shape[self.stage_axis] if stage_axes else 1
    self.microbatches = setup.options.microbatches
    self.average_in_backward = average_in_backward
    self.mesh_shape = dict(setup.mesh.shape)
    self.compute_dtype = jnp.dtype(setup.options.compute_dtype)
    self.reduce_dtype = jnp.dtype(setup.options.grad_reduce_dtype)
    self.gather = gather
    self.flat_gather = setup.options.flat_gather
    keep = REMAT_POLICIES[setup.options.remat] or jax.checkpoint_policies.everything_saveable
    # Neither gathered weights nor the cuts and casts that make them (flat_gather) are kept for
    # the backward pass, whatever the policy: peak memory holds one layer's full parameters.
    self.remat_policy = lambda prim, *args, **params: (
        prim.name not in _NOT_KEPT and keep(prim, *args, **params))

  def gathered(self, values: list, logical_axes: list) -> list:
    """The parameters with their FSDP-split dimensions all-gathered, those split alike in one
    all_gather (engine/parallel/flat_gather.py), in the reduction dtype (the gather's transpose,
    a reduce-scatter, then moves the gradient in that dtype)."""
    splits = [flat_gather.split_dims(self.rules, axes) for axes in logical_axes]
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
    stored = spec_axes(self.rules.spec(logical_axes, activation=False))
    replicated = tuple(a for a in self.batch_axes if a not in stored)
    return replicated, math.prod(self.mesh_shape[a] for a in self.batch_axes if a in stored)

  def _prepared(self, values: list, logical_axes: list) -> list:
    if self.average_in_backward:
      values = [_averaged_in_backward(v, *self.batch_reduction(axes), self.reduce_dtype)
                for v, axes in zip(values, logical_axes)]
    if self.gather:
      values = self.gathered(values, logical_axes)
    return [v.astype(self.compute_dtype) for v in values]

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

  def _shard_index(self, axes) -> jax.Array:
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
    first = self._shard_index(head_axes) * local_heads  # This device's first query head.
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
    return axes, self._shard_index(axes) * local_vocab

  def inputs_and_targets(self, tokens_BL1):
    if self.context_axis is None:
      return super().inputs_and_targets(tokens_BL1)
    return context.local_sequence(tokens_BL1, self.context_axis, self.context_size)

  def positions(self, length):
    if self.context_axis is None or self.documents is not None:
      return super().positions(length)
    return context.local_positions(length, self.context_axis, self.context_size)

  def attention(self, q_BLHK, k_BLnK, v_BLnK, scale_on='queries', implementation='einsum',
                scale=None):
    if self.context_axis is None:
      return super().attention(q_BLHK, k_BLnK, v_BLnK, scale_on, implementation, scale)
    return context.ring_attention(q_BLHK, k_BLnK, v_BLnK, self.context_axis, self.context_size,
                                  scale_on, scale, implementation, self.segments())

  def embed_lookup(self, table_VD, tokens_BL):
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
                                     ffn, num_experts, axis, self.mesh_shape[axis])
    return y_TKD.reshape(B, L, K, -1), jnp.zeros((), jnp.float32)

  def batch_mean(self, x):
    # Every device's loss then holds the same shared term; pmean's transpose gives each device
    # the share of its gradient that the step's average over the batch axes expects.
    return jax.lax.pmean(x, self.batch_axes) if self.batch_axes else x

  def cross_entropy(self, logits_BLV, targets_BL, keep_BL=None, count=None):
    axes, first = self._vocab_shard(logits_BLV.shape[-1])
    if not axes:
      return super().cross_entropy(logits_BLV, targets_BL, keep_BL, count)
    logits_BLV = logits_BLV.astype(jnp.float32)
    # The max only stabilises the exponentials; it needs no gradient.
    max_BL = jax.lax.pmax(jax.lax.stop_gradient(logits_BLV.max(-1)), axes)
    sum_exp_BL = jax.lax.psum(jnp.exp(logits_BLV - max_BL[..., None]).sum(-1), axes)
    local_BL = targets_BL - first
    mine_BL = (local_BL >= 0) & (local_BL < logits_BLV.shape[-1])
    target_logit_BL = jnp.take_along_axis(
        logits_BLV, jnp.where(mine_BL, local_BL, 0)[..., None], axis=-1)[..., 0]
    target_logit_BL = jax.lax.psum(jnp.where(mine_BL, target_logit_BL, 0.0), axes)
    return reduce_losses(jnp.log(sum_exp_BL) + max_BL - target_logit_BL, keep_BL, count)


class _Gradients:
  """The manual step's loss and gradients on local shards, synchronised one of three ways:
  averaged inside the backward pass (one micro-batch, no pipeline), or once after it
  (micro-batches accumulated, or the pipeline's iterations), with FSDP weights gathered once per
  step when there are micro-batches to accumulate."""

  def __init__(self, setup: TrainSetup):
    self.setup = setup
    # With pipeline stages the micro-batches feed the schedule (ops.stack); gradients are taken
    # once for the whole batch.
    pipelined = bool(setup.rules.mesh_axes('layers'))
    self.microbatches = 1 if pipelined else setup.options.microbatches
    # Where the backward pass runs each layer more than once (micro-batches accumulated, or the
    # pipeline's iterations), gradients are synchronised after it, once, not in it.
    self.sync_after = self.microbatches > 1 or pipelined
    self.ops = ManualOps(setup, average_in_backward=not self.sync_after)
    self.reduce_dtype = jnp.dtype(setup.options.grad_reduce_dtype)
    self.gathers = any(setup.rules.gather_axes(name) for p in setup.parameters()
                       for name in p.logical_axes)

  def map_param_values(self, tree, fn, together: bool = False):
    """fn(value, logical axes) on a tree laid out like the parameters; `together`:
    fn(values, logical axes of each) on all of them at once."""
    module = (map_params_together if together else map_params)(
        nnx.merge(self.setup.graphdef, tree), fn)
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))

  def average(self, grads):
    """Each gradient's pmean over the batch axes, after the backward pass (micro-batches)."""
    return self.map_param_values(grads, lambda g, axes: _average_over_batch(
        g, *self.ops.batch_reduction(axes), self.reduce_dtype))

  def local_loss(self, params, tokens_BL1, count, ops=None):
    """(loss, the model's statistics for the metrics), on this device's tokens; `count`: the
    packed documents' kept predictions (steps.kept_count), or None."""
    return next_token_loss(params, self.setup.graphdef, tokens_BL1, ops or self.ops,
                           with_stats=True, eos_id=self.setup.options.eos_id, count=count)

  def local_gradients(self, params, tokens_BL1, count):
    """One micro-batch: `ops` averages each gradient inside the backward pass."""
    return jax.value_and_grad(self.local_loss, has_aux=True)(params, tokens_BL1, count)

  def accumulated_gradients(self, params, tokens_BL1, count):
    """Gradients w.r.t. a local copy of each parameter (gathered ones arrive reduce-scattered
    by the gathers' transposes, once per micro-batch), then one pmean over the batch axes."""
    local_params = self.map_param_values(params, lambda p, axes: _cast_to_varying(
        p, self.ops.batch_reduction(axes)[0]))
    value, grads = accumulate_gradients(
        jax.value_and_grad(lambda p, t: self.local_loss(p, t, count), has_aux=True),
        local_params, tokens_BL1, self.microbatches)
    return value, self.average(grads)

  def gradients_gathered_once(self, params, tokens_BL1, count):
    """Micro-batches under FSDP: every split weight is gathered once for the whole step and the
    gradients w.r.t. the gathered copies accumulate locally, so each is reduce-scattered (and
    averaged) once per optimizer step rather than once per micro-batch. The price is ZeRO-2
    memory: whole weights and whole gradients on every device during the step."""
    whole = self.map_param_values(params, self.ops.gathered, together=True)
    # all_gather leaves its result typed as varying over the gathered axes; cast over the other
    # batch axes too, so the gradients w.r.t. these copies stay local.
    whole = self.map_param_values(whole, lambda w, axes: _cast_to_varying(
        w, self.ops.batch_reduction(axes)[0]))
    pregathered = ManualOps(self.setup, gather=False)
    value, grads = accumulate_gradients(
        jax.value_and_grad(lambda p, t: self.local_loss(p, t, count, pregathered), has_aux=True),
        whole, tokens_BL1, self.microbatches)
    scattered = self.map_param_values(grads, self.ops.scattered, together=True)
    return value, self.average(scattered)

  def __call__(self, params, tokens_BL1):
    """(mean loss over the global batch, synchronised gradients)."""
    return self.with_stats(params, tokens_BL1)[:2]

  def with_stats(self, params, tokens_BL1):
    """(mean loss, synchronised gradients, the model's statistics over the global batch)."""
    if not self.sync_after:
      grads_fn = self.local_gradients
    else:
      grads_fn = self.gradients_gathered_once if self.gathers else self.accumulated_gradients
    # The statistics are already the same on every device: token means averaged over the batch
    # shards in the layer (ops.batch_mean), broadcast from the last pipeline stage.
    # Packed documents: every micro-batch's loss divides by the whole batch's kept count.
    count = kept_count(self.ops, tokens_BL1, self.setup.options.eos_id, self.microbatches)
    (loss, stats), grads = grads_fn(params, tokens_BL1, count)
    return self.batch_mean(loss), grads, stats

  def batch_mean(self, loss):
    return self.ops.batch_mean(loss)

  def global_norm(self, grads):
    # Each shard's squared norm is summed over the axes that split that parameter.
    squares = jax.tree.map(
        lambda g, spec: _psum_if(jnp.sum(jnp.square(g.astype(jnp.float32))), spec_axes(spec)),
        grads, self.setup.state_specs()['params'])
    return jnp.sqrt(sum(jax.tree.leaves(squares)))


def _shard_mapped(setup: TrainSetup, fn, in_specs, out_specs, donate=False):
  """fn on local shards inside shard_map, jitted with the matching global shardings."""
  return jax.jit(jax.shard_map(fn, mesh=setup.mesh, in_specs=in_specs, out_specs=out_specs),
                 in_shardings=named(setup.mesh, in_specs),
                 out_shardings=named(setup.mesh, out_specs),
                 donate_argnums=0 if donate else ())


def build_steps(setup: TrainSetup) -> Steps:
  gradients = _Gradients(setup)
  state_specs = setup.state_specs()
  param_specs = state_specs['params']
  batch_spec = setup.batch_sharding().spec

  def train_step(state, tokens_BL1):
    loss, grads, stats = gradients.with_stats(state['params'], tokens_BL1)
    return apply_update(setup, state, loss, grads, gradients.global_norm(grads), stats)

  def eval_step(params, tokens_BL1):
    return gradients.batch_mean(next_token_loss(params, setup.graphdef, tokens_BL1,
                                                gradients.ops, with_aux=False,
                                                eos_id=setup.options.eos_id))

  def window_losses_step(params, tokens_BL1):
    # Each device sums its positions of its rows; a split sequence adds its devices' sums.
    sums = window_losses(params, setup.graphdef, tokens_BL1, gradients.ops,
                         setup.options.eos_id)
    axis = gradients.ops.context_axis
    return jax.tree.map(lambda x: jax.lax.psum(x, axis), sums) if axis else sums

  rows_spec = P(batch_spec[0])  # [B], split like the windows.
  return Steps(
      train=_shard_mapped(setup, train_step, (state_specs, batch_spec), (state_specs, P()),
                          donate=True),
      eval=_shard_mapped(setup, eval_step, (param_specs, batch_spec), P()),
      gradients=_shard_mapped(setup, gradients, (param_specs, batch_spec), (P(), param_specs)),
      window_losses=_shard_mapped(setup, window_losses_step, (param_specs, batch_spec),
                                  (rows_spec, rows_spec)))


def _averaged_in_backward(param, replicated_axes, scatter_factor, reduce_dtype):
  """`param` as a local copy, varying over `replicated_axes`; the backward pass turns its
  gradient into the batch mean right there (`_average_over_batch`)."""
  if not replicated_axes and scatter_factor == 1:
    return param

  @jax.custom_vjp
  def local_copy(p):
    return _cast_to_varying(p, replicated_axes)

  def forward(p):
    return local_copy(p), None

  def backward(_, grad):
    return (_average_over_batch(grad, replicated_axes, scatter_factor, reduce_dtype)
            .astype(param.dtype),)

  local_copy.defvjp(forward, backward)
  return local_copy(param)


def _average_over_batch(grad, replicated_axes, scatter_factor, reduce_dtype=jnp.float32):
  """One explicit pmean (in `reduce_dtype`) over the batch axes the parameter is replicated on;
  gathered batch axes already summed their shards' gradients in the psum_scatter, so divide by
  their size. Returns float32, the parameters' dtype."""
  if replicated_axes:
    grad = jax.lax.pmean(grad.astype(reduce_dtype), replicated_axes)
  grad = grad.astype(jnp.float32)
  return grad / scatter_factor if scatter_factor > 1 else grad


def _cast_to_varying(param, axes):
  """A local copy of a parameter replicated over `axes`, so its gradient stays local."""
  return jax.lax.pcast(param, axes, to='varying') if axes else param


def _psum_if(x, axes):
  return jax.lax.psum(x, axes) if axes else x
