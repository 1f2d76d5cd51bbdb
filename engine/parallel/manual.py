"""Manual mode: the whole train step inside `jax.shard_map`, every collective written here.

The collectives come from the same rules that give auto mode its shardings:

- A parameter dimension whose logical name maps to mesh axes in the parameter rules but not in
  the activation rules (FSDP's `embed` -> fsdp) is `all_gather`ed before use, the weights split
  alike in one collective (engine/parallel/flat_gather.py): a stacked layer's when that layer
  starts (`ops.layer`, in the layer scan and under remat: one layer's gathered weights alive at a
  time, gathered again in the backward pass), the others once before the model runs. The
  gather's transpose, a `psum_scatter`, reduce-scatters the gradients. The model reads
  parameters the plain Flax way. Two are never gathered where they are used once per step
  (engine/parallel/manual_ops.py): an untied token embedding, looked up on each device's columns
  (the group's tokens gathered, the rows exchanged with `all_to_all`), and under a chunked loss
  an untied head, exchanged to a slice of the vocabulary, each chunk's features gathered.
- A contraction over a dimension that the activation rules shard (Megatron's row-parallel
  attention-out and MLP-down over `heads` / `mlp` -> tensor) ends with a `psum` over those axes.
  Its column-parallel partner needs nothing in the forward pass; JAX's varying-axes types turn the
  broadcast of the replicated activation into the backward `psum`.
- A vocabulary sharded over `tensor` gets a vocab-parallel embedding lookup (masked local lookup,
  `psum`) and a vocab-parallel cross-entropy (`pmax` / `psum` of the logsumexp terms).
- A sequence split over `context` (activations' `length`): each device keeps two chunks of every
  sequence and attention passes keys and values around the ring with `ppermute`
  (engine/parallel/context.py); the context axis counts as a batch axis for the averages below.
- Stacked layers split over `stage` run as a GPipe pipeline (engine/parallel/pipeline/gpipe.py): the
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

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine.models.moe import balance as expert_balance
from engine.parallel import manual_ops, zero1
from engine.parallel.pipeline import gpipe as pipeline
from engine.parallel.pipeline import one_f_one_b as pipeline_1f1b
from engine.parallel.pipeline import stage_lanes
from engine.parallel.muon_blocks import MatrixBlocks
from engine.parallel.pipeline.model_cut import ModelCut
from engine.parallel.steps import (Steps, accumulate_gradients, apply_update, kept_count,
                                   map_params, map_params_together, next_token_loss,
                                   optimizer_on_device, trainable_only, window_losses)
from engine.sharding import named, spec_axes
from engine.state import TrainSetup


class _Gradients:
  """The manual step's loss and gradients on local shards, synchronised one of three ways:
  averaged inside the backward pass (one micro-batch, no pipeline), or once after it
  (micro-batches accumulated, or the pipeline's iterations), with FSDP weights gathered once per
  step when there are micro-batches to accumulate."""

  def __init__(self, setup: TrainSetup):
    self.setup = setup
    # With pipeline stages the micro-batches feed the schedule (ops.stack); gradients are taken
    # once for the whole batch.
    self.pipelined = bool(setup.rules.mesh_axes('layers'))
    self.microbatches = 1 if self.pipelined else setup.options.microbatches
    # ZeRO-1 (engine/parallel/zero1.py): each gradient reduce-scattered to its moments' block.
    self.zero1 = setup.options.optimizer_sharding == 'zero1'
    self.moment_specs, self.param_specs = setup.moment_specs(), setup.param_specs
    # Where the backward pass runs each layer more than once (micro-batches accumulated, or the
    # pipeline's iterations), and under ZeRO-1, gradients are synchronised after it, once.
    self.sync_after = self.microbatches > 1 or self.pipelined or self.zero1
    self.ops = manual_ops.ManualOps(setup, average_in_backward=not self.sync_after)
    self.reduce_dtype = jnp.dtype(setup.options.grad_reduce_dtype)
    self.gathers = any(setup.rules.gather_axes(name) for p in setup.parameters()
                       for name in p.logical_axes)
    self.one_f_one_b = (self.pipelined and
                        setup.options.pipeline_schedule in pipeline.SELF_DIFFERENTIATING)

  def map_param_values(self, tree, fn, together: bool = False):
    """fn(value, logical axes) on a tree laid out like the parameters; `together`:
    fn(values, logical axes of each) on all of them at once."""
    module = (map_params_together if together else map_params)(
        nnx.merge(self.setup.graphdef, tree), fn)
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))

  def average(self, grads):
    """Each gradient's pmean over the batch axes, after the backward pass (micro-batches); under
    ZeRO-1 its reduce-scatter to the block of its moments."""
    if not self.zero1:
      return self.map_param_values(grads, lambda g, axes: manual_ops.average_over_batch(
          g, *self.ops.batch_reduction(axes), self.reduce_dtype))
    return jax.tree.map(
        lambda g, param_spec, moment_spec: zero1.reduced_gradient(
            g, param_spec, moment_spec, *self.ops.spec_reduction(param_spec),
            self.ops.mesh_shape, self.reduce_dtype),
        grads, self.param_specs, self.moment_specs)

  def local_loss(self, params, tokens_BL1, count, ops=None):
    """(loss, the model's statistics for the metrics), on this device's tokens; `count`: the
    packed documents' kept predictions (steps.kept_count), or None."""
    return next_token_loss(params, self.setup.graphdef, tokens_BL1, ops or self.ops,
                           with_stats=True, eos_id=self.setup.options.eos_id, count=count,
                           loss_chunks=self.setup.options.loss_chunks)

  def local_gradients(self, params, tokens_BL1, count):
    """One micro-batch: `ops` averages each gradient inside the backward pass."""
    return jax.value_and_grad(self.local_loss, has_aux=True)(params, tokens_BL1, count)

  def accumulated_gradients(self, params, tokens_BL1, count):
    """Gradients w.r.t. a local copy of each parameter (gathered ones arrive reduce-scattered
    by the gathers' transposes, once per micro-batch), then one pmean over the batch axes."""
    local_params = self.map_param_values(params, lambda p, axes: manual_ops.cast_to_varying(
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
    whole = self.map_param_values(whole, lambda w, axes: manual_ops.cast_to_varying(
        w, self.ops.batch_reduction(axes)[0]))
    pregathered = manual_ops.ManualOps(self.setup, gather=False)
    value, grads = accumulate_gradients(
        jax.value_and_grad(lambda p, t: self.local_loss(p, t, count, pregathered), has_aux=True),
        whole, tokens_BL1, self.microbatches)
    scattered = self.map_param_values(grads, self.ops.scattered, together=True)
    return value, self.average(scattered)

  def scheduled_gradients(self, params, tokens_BL1):
    """The 1F1B pipeline, plain or interleaved (engine/parallel/pipeline/one_f_one_b.py): gradients
    w.r.t. local copies of the parameters, as accumulated_gradients takes them. A stage's own layers
    gather their FSDP-split weights where each tick runs them (one layer's alive at a time, as in
    GPipe); the weights outside the stack (the embedding, the head: every tick's head reads them)
    are gathered once for the step and reduce-scattered once after it, and cast to varying over
    `stage` too: each stage's gradient of them (the embedding's on the first stage, the head's on
    the last) is summed over the stages. Then one pmean over the batch axes."""
    ops, setup = self.ops, self.setup
    stage_axis, microbatches = ops.stage_axis, setup.options.microbatches
    local = self.map_param_values(params, lambda p, axes: manual_ops.cast_to_varying(
        p, ops.batch_reduction(axes)[0]))

    def outer_copies(values, logical_axes):
      if self.gathers:
        values = ops.gathered(values, logical_axes)
      return [manual_ops.cast_to_varying(v, tuple(
          a for a in (*ops.batch_reduction(axes)[0], stage_axis)
          if a not in jax.typeof(v).manual_axis_type.varying))
              for v, axes in zip(values, logical_axes)]

    outer = self._map_outer(local, outer_copies)
    outer_ops = manual_ops.ManualOps(setup, gather=False) if self.gathers else ops
    loss_fn, rows = pipeline_1f1b.step_loss(setup, ops, tokens_BL1)
    cut = ModelCut(loss_fn, local, tokens_BL1, ops)
    loss, stats, d_outer, d_stage = pipeline_1f1b.one_f_one_b(
        cut, stage_lanes.Lanes(stage_axis, ops.stages), outer, cut.layers_params(local),
        tokens_BL1, microbatches, outer_ops, rows, cut.chunks, setup.options.pipeline_head,
        split_backward=setup.options.pipeline_schedule == 'zb_h1')
    if self.gathers:
      d_outer = self._map_outer(d_outer, ops.scattered)
    # Scattered first: the sum over the stages then moves a shard of each gradient.
    over_stages = lambda tree, *_: jax.tree.map(lambda a: jax.lax.psum(a, stage_axis), tree)
    grads = cut.with_layers_params(self._map_outer(d_outer, over_stages), d_stage)
    return (over_stages(loss), over_stages(stats)), self.average(grads)

  def _map_outer(self, tree, fn):
    """fn(values, logical axes of each) on the parameters outside the stack of a tree laid out
    like the parameters."""
    return nnx.to_pure_dict(nnx.state(map_params_together(
        nnx.merge(self.setup.graphdef, tree), fn, skip_stacked=True), nnx.Param))

  def __call__(self, params, tokens_BL1):
    """(mean loss over the global batch, synchronised gradients)."""
    return self.with_stats(params, tokens_BL1)[:2]

  def with_stats(self, params, tokens_BL1):
    """(mean loss, synchronised gradients, the model's statistics over the global batch)."""
    if self.one_f_one_b:
      (loss, stats), grads = self.scheduled_gradients(params, tokens_BL1)
      return self.batch_mean(loss), grads, stats
    if not self.sync_after:
      grads_fn = self.local_gradients
    elif self.gathers and (self.microbatches > 1 or self.pipelined):
      grads_fn = self.gradients_gathered_once
    else:
      grads_fn = self.accumulated_gradients
    # The statistics are already the same on every device: token means averaged over the batch
    # shards in the layer (ops.batch_mean), broadcast from the last pipeline stage.
    # Packed documents: every micro-batch's loss divides by the whole batch's kept count.
    count = kept_count(self.ops, tokens_BL1, self.setup.options.eos_id, self.microbatches)
    (loss, stats), grads = grads_fn(params, tokens_BL1, count)
    return self.batch_mean(loss), grads, stats

  def batch_mean(self, loss):
    return self.ops.batch_mean(loss)

  def global_norm(self, grads):
    # Each shard's squared norm is summed over the axes that split that gradient (under ZeRO-1
    # laid out as its moments).
    squares = jax.tree.map(
        lambda g, spec: manual_ops.psum_if(jnp.sum(jnp.square(g.astype(jnp.float32))),
                                           spec_axes(spec)),
        grads, self.moment_specs)
    return jnp.sqrt(sum(jax.tree.leaves(squares)))


class _BiasBlocks(expert_balance.WholeBias):
  """The router biases as manual mode holds them: a block on each device (a pipeline splits the
  layers over the stages)."""

  def __init__(self, setup: TrainSetup, ops: manual_ops.ManualOps):
    self.specs, self.ops = setup.param_specs, ops

  def _splits(self, path, ndim):
    spec = functools.reduce(lambda tree, key: tree[key.key], path, self.specs)
    return [spec_axes(P(axes)) if axes else () for axes in (*spec, *[None] * (ndim - len(spec)))]

  def block(self, whole, path, local):
    splits = self._splits(path, local.ndim)
    counts = [math.prod(self.ops.mesh_shape[a] for a in axes) for axes in splits]
    block = whole.reshape([n * size for n, size in zip(counts, local.shape)])
    for dim, (axes, size) in enumerate(zip(splits, local.shape)):
      if axes:
        start = self.ops.shard_index(axes) * size
        block = jax.lax.dynamic_slice_in_dim(block, start, size, dim)
    return block

  def extremes(self, local, path):
    axes = sum(self._splits(path, local.ndim), ())
    low, high = local.min(), local.max()
    return (jax.lax.pmin(low, axes), jax.lax.pmax(high, axes)) if axes else (low, high)


def _shard_mapped(setup: TrainSetup, fn, in_specs, out_specs):
  """fn on local shards inside shard_map, jitted with the matching global shardings."""
  return jax.jit(jax.shard_map(fn, mesh=setup.mesh, in_specs=in_specs, out_specs=out_specs),
                 in_shardings=named(setup.mesh, in_specs),
                 out_shardings=named(setup.mesh, out_specs))


def _train_step_jitted(setup: TrainSetup, train_step, batch_spec):
  """The train step on local shards, jitted with the state's shardings: the optimizer state
  moves between host memory and the devices outside the shard_map (optimizer_on_device)."""
  state_specs = setup.state_specs()
  mapped = jax.shard_map(train_step, mesh=setup.mesh, in_specs=(state_specs, batch_spec),
                         out_specs=(state_specs, P()))
  state_shardings = setup.state_shardings()
  return jax.jit(optimizer_on_device(setup, mapped),
                 in_shardings=(state_shardings, named(setup.mesh, batch_spec)),
                 out_shardings=(state_shardings, named(setup.mesh, P())), donate_argnums=0)


def build_steps(setup: TrainSetup) -> Steps:
  gradients = _Gradients(setup)
  state_specs = setup.state_specs()
  param_specs = state_specs['params']
  batch_spec = setup.batch_sharding().spec

  # Muon orthogonalizes whole matrices: each split one exchanged or gathered (muon_blocks.py).
  tx = setup.optimizer.blockwise(MatrixBlocks(setup).on_whole_matrices)

  def train_step(state, tokens_BL1):
    loss, grads, stats = gradients.with_stats(state['params'], tokens_BL1)
    grads = trainable_only(setup.model, grads)
    norm = gradients.global_norm(grads)
    if not gradients.zero1:
      return apply_update(setup, state, loss, grads, norm, stats,
                          _BiasBlocks(setup, gradients.ops), tx)
    # ZeRO-1: the update on this device's block of each parameter, then the blocks gathered.
    specs = gradients.param_specs, gradients.moment_specs
    blocks = jax.tree.map(lambda p, *s: zero1.parameter_block(p, *s, gradients.ops),
                          state['params'], *specs)
    state, metrics = apply_update(setup, {**state, 'params': blocks}, loss, grads, norm, stats)
    params = jax.tree.map(zero1.whole_parameter, state['params'], *specs)
    return {**state, 'params': params}, metrics

  def eval_step(params, tokens_BL1):
    return gradients.batch_mean(next_token_loss(params, setup.graphdef, tokens_BL1,
                                                gradients.ops, with_aux=False,
                                                eos_id=setup.options.eos_id,
                                                loss_chunks=setup.options.loss_chunks))

  def window_losses_step(params, tokens_BL1):
    # Each device sums its positions of its rows; a split sequence adds its devices' sums.
    sums = window_losses(params, setup.graphdef, tokens_BL1, gradients.ops,
                         setup.options.eos_id)
    axis = gradients.ops.context_axis
    return jax.tree.map(lambda x: jax.lax.psum(x, axis), sums) if axis else sums

  rows_spec = P(batch_spec[0])  # [B], split like the windows.
  return Steps(
      train=_train_step_jitted(setup, train_step, batch_spec),
      eval=_shard_mapped(setup, eval_step, (param_specs, batch_spec), P()),
      # The gradients as the step reduces them: laid out as the moments (under ZeRO-1, blocks).
      gradients=_shard_mapped(setup, gradients, (param_specs, batch_spec),
                              (P(), setup.moment_specs())),
      window_losses=_shard_mapped(setup, window_losses_step, (param_specs, batch_spec),
                                  (rows_spec, rows_spec)))
