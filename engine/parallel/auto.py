"""Auto mode: jax.jit with NamedShardings from the rules; XLA's SPMD partitioner inserts every
collective."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from engine import sharding
from engine.models.moe import dispatch as moe_dispatch
from engine.models.attention.causal import causal_attention
from engine.models.ops import LocalOps
from engine.parallel import expert_exchange
from engine.parallel.pipeline import gpipe as pipeline
from engine.parallel.pipeline import one_f_one_b as pipeline_1f1b
from engine.parallel.pipeline import stage_lanes
from engine.parallel.pipeline.model_cut import ModelCut
from engine.parallel.steps import (REMAT_POLICIES, Steps, accumulate_gradients, apply_update,
                                   kept_count, map_params, next_token_loss, optimizer_on_device,
                                   trainable_only, window_losses)
from engine.state import TrainSetup


class AutoOps(LocalOps):
  """Activations and parameters get sharding constraints from the rules; XLA does the rest."""

  def __init__(self, setup: TrainSetup):
    self.mesh = setup.mesh
    self.rules = setup.rules
    self.compute_dtype = jnp.dtype(setup.options.compute_dtype)
    self.remat_policy = REMAT_POLICIES[setup.options.remat]  # None: no rematerialisation.
    self.microbatches = setup.options.microbatches
    self.exchanged_dropless = expert_exchange.exchanges_dropless(setup, 'auto')
    self.exchange = expert_exchange.exchange_kind(setup)
    self.ragged_dot = expert_exchange.ragged_dot_for(setup)

  def constrain(self, x, logical_axes, activation=True):
    spec = self.rules.spec(logical_axes, activation=activation)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def _prepared(self, value, logical_axes):
    # Pinned to its stored layout so that the compiler gathers it where it is used instead of
    # re-laying-out whole tensors; then cast to the compute dtype.
    return self.constrain(value, logical_axes, activation=False).astype(self.compute_dtype)

  def prepare_params(self, module, skip_stacked=True):
    return map_params(module, self._prepared, skip_stacked)

  def layer(self, fn):
    prepared = lambda layer, *args: fn(self.prepare_params(layer, skip_stacked=False), *args)
    if self.remat_policy is None:
      return prepared
    return nnx.remat(prepared, policy=self.remat_policy)

  def stack(self, run, layers, x):
    if not self.rules.mesh_axes('layers'):
      return super().stack(run, layers, x)
    return pipeline.auto_pipeline(run, layers, x, self.mesh.shape['stage'], self.microbatches,
                                  self._by_stage, self.constrain, rows=self.documents)

  def _by_stage(self, a, logical_axes, activation=True):
    """`a`'s first dimension over `stage`, the others by the rules (pipeline.auto_pipeline)."""
    spec = self.rules.spec(logical_axes, activation=activation)
    return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, P('stage', *spec)))

  def kv_for_query_heads(self, kv_BLNK, num_heads):
    if self.rules.mesh_axes('kv_heads', activation=True) or not self.rules.mesh_axes(
        'heads', activation=True):
      # Split like the query heads, or nothing split: the attention's grouped einsum reads
      # them in place (the query heads' split lands on the kv heads' dimension).
      return self.constrain(kv_BLNK, ('batch', 'length', 'kv_heads', 'head_dim'))
    # Replicated (too few to split) under split query heads: each query head's kv head, laid
    # out like the query heads, so every device keeps only the copies its heads read.
    return self.constrain(jnp.repeat(kv_BLNK, num_heads // kv_BLNK.shape[2], axis=2),
                          ('batch', 'length', 'heads', 'head_dim'))

  def experts(self, x_BLD, experts_BLK, ffn, num_experts, slots):
    if not self.rules.mesh_axes('experts', activation=True):
      return super().experts(x_BLD, experts_BLK, ffn, num_experts, slots)
    if slots is None and self.exchanged_dropless:
      return self._exchanged_dropless(x_BLD, experts_BLK, ffn, num_experts)
    # Grouped matmuls over expert-split weights compile with the experts all-gathered; the slot
    # buffer laid out by expert lets the compiler move the tokens instead (all-to-all). Dropless
    # is here the capacity dispatch with a slot for every position: nothing can drop, at E / K
    # times the useful expert FLOPs (pipelines, whose stages run under vmap).
    # Both layouts are pinned: left to itself, the compiler gathers the tokens to the experts.
    by_batch = lambda x_EBCD: self.constrain(x_EBCD, (None, 'batch', None, None))
    by_expert = lambda x_EBCD: self.constrain(x_EBCD, ('experts', 'expert_groups', None, None))
    y_BLKD, dropped = moe_dispatch.with_capacity(
        x_BLD, experts_BLK, ffn, num_experts, slots or experts_BLK.shape[1],
        lambda x_EBCD, through_experts: by_batch(by_expert(through_experts(
            by_expert(by_batch(x_EBCD))))))
    if slots is None:
      dropped = jnp.zeros((), jnp.float32)
    return y_BLKD, dropped

  def _exchanged_dropless(self, x_BLD, experts_BLK, ffn, num_experts):
    """Manual mode's dropless exchange (engine/parallel/expert_exchange.py) inside a shard_map:
    each device routes its own tokens and sends them to their experts' devices (exchange_kind),
    whose grouped matmuls multiply only the rows in use. The experts' weights come whole
    along `embed` (the compiler gathers them where FSDP splits them); a hidden dimension split
    over `tensor` is summed after the down projection, as manual mode's."""
    (axis,) = self.rules.mesh_axes('experts', activation=True)
    rows = self.rules.spec(('batch', 'length', None), activation=True)
    hidden = self.rules.mesh_axes('mlp', activation=True)
    weights = P(axis, None, hidden or None), P(axis, hidden or None, None)

    def local(x_BLD, experts_BLK, w_gate_EDF, w_up_EDF, w_down_EFD):
      finish = (lambda y: jax.lax.psum(y, hidden)) if hidden else (lambda y: y)
      here = moe_dispatch.ExpertFFN(w_gate_EDF, w_up_EDF, w_down_EFD, finish, ffn.precision,
                                    ffn.ragged_dot)
      B, L, K = experts_BLK.shape
      y_TKD = expert_exchange.dropless(x_BLD.reshape(B * L, -1), experts_BLK.reshape(B * L, K),
                                       here, num_experts, axis, self.mesh.shape[axis],
                                       self.exchange)
      return y_TKD.reshape(B, L, K, -1)

    y_BLKD = jax.shard_map(
        local, mesh=self.mesh, in_specs=(rows, rows, weights[0], weights[0], weights[1]),
        out_specs=P(*rows, None))(x_BLD, experts_BLK, ffn.w_gate_EDF, ffn.w_up_EDF,
                                  ffn.w_down_EFD)
    return y_BLKD, jnp.zeros((), jnp.float32)

  def attention(self, q_BLHK, k_BLHK, v_BLHK, spec):
    if spec.implementation != 'splash':
      return super().attention(q_BLHK, k_BLHK, v_BLHK, spec)
    # The Pallas kernel is one device's program, which the SPMD partitioner cannot split: each
    # device runs it on its own batch rows and heads (whole sequences; validation refuses a
    # split length), as in manual mode. Unchecked (check_vma=False): nothing inside communicates,
    # and the kernel's outputs carry no varying-axes types (engine/models/attention/splash.py),
    # which a checked shard_map under the pipeline's vmap over stages refuses.
    heads = self.rules.spec(('batch', None, 'heads', None), activation=True)
    # Grouped keys / values come with their own heads (split like the query heads, or repeated
    # to them by kv_for_query_heads).
    kv_heads = heads if k_BLHK.shape[2] == q_BLHK.shape[2] else self.rules.spec(
        ('batch', None, 'kv_heads', None), activation=True)
    segments_BL = self.segments()  # Packed documents: each row's segment ids go with it.

    def local(q, k, v, *segments):
      return causal_attention(q, k, v, spec, *segments)

    in_specs = (heads, kv_heads, kv_heads) + (() if segments_BL is None else (
        self.rules.spec(('batch', None), activation=True),))
    args = (q_BLHK, k_BLHK, v_BLHK) + (() if segments_BL is None else (segments_BL,))
    return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=heads,
                         check_vma=False)(*args)

  def embed_lookup(self, table_VD, tokens_BL):
    # XLA partitions a gather from a table split only along the vocabulary as a masked local
    # lookup and one all-reduce of the result, with no FLOPs (a one-hot matmul costs 2*B*L*V*D);
    # a table also split along `embed` would be gathered whole first, so gather that split
    # here, as FSDP does for every weight where it is used.
    table_VD = self.constrain(table_VD, ('vocab', None), activation=False)
    return jnp.take(table_VD, tokens_BL, axis=0)


def one_f_one_b_gradients(setup: TrainSetup, ops: AutoOps, params, tokens_BL1):
  """(mean loss, gradients, the model's statistics) from the 1F1B pipeline, plain or interleaved
  (engine/parallel/pipeline/one_f_one_b.py): each stage's layers as one slice of [S, L / S, ...]
  arrays (interleaved: [S, V, L / (S V), ...]) laid out over `stage`, the activations that move
  between stages as [S, ...] arrays."""
  stages = setup.mesh.shape['stage']
  loss_fn, rows = pipeline_1f1b.step_loss(setup, ops, tokens_BL1)
  cut = ModelCut(loss_fn, params, tokens_BL1, ops)
  layers = nnx.merge(cut.stack_graphdef, cut.layers_params(params))
  staged = nnx.to_pure_dict(pipeline.split_by_stage(nnx.state(layers), stages, ops._by_stage,
                                                    grouped=cut.chunks > 1))
  x_axes = ('batch', 'length', 'embed')
  lanes = stage_lanes.StackedLanes(
      stages, lambda x, stash: ops._by_stage(x, ((None,) if stash else ()) + x_axes),
      lambda a: ops._by_stage(a, (None,) * (a.ndim - 1)),
      lambda rows: ops._by_stage(rows, ('batch',) + (None,) * (rows.ndim - 2)),
      row_ways=math.prod(setup.mesh.shape[a] for a in setup.rules.mesh_axes('batch', True)),
      positions_split=not setup.rules.mesh_axes('length', True))
  loss, stats, d_outer, d_staged = pipeline_1f1b.one_f_one_b(
      cut, lanes, params, staged, tokens_BL1, setup.options.microbatches, ops, rows, cut.chunks,
      setup.options.pipeline_head, split_backward=setup.options.pipeline_schedule == 'zb_h1')
  d_layers = jax.tree.map(lambda g: pipeline.stack_by_depth(g, cut.chunks > 1), d_staged)
  return loss, cut.with_layers_params(d_outer, d_layers), stats


def build_steps(setup: TrainSetup) -> Steps:
  ops = AutoOps(setup)
  state_shardings = setup.state_shardings()
  params_shardings = state_shardings['params']
  batch = setup.batch_sharding()
  replicated = NamedSharding(setup.mesh, P())
  micro_batches = NamedSharding(setup.mesh, P(None, *batch.spec))

  eos_id = setup.options.eos_id  # Packed documents (data.document_masking), or None.

  def loss_fn(params, tokens_BL1, count):  # (loss, the model's statistics for the metrics)
    return next_token_loss(params, setup.graphdef, tokens_BL1, ops, with_stats=True,
                           eos_id=eos_id, count=count, loss_chunks=setup.options.loss_chunks)

  # With pipeline stages the micro-batches feed the schedule (ops.stack) instead.
  accumulated = 1 if setup.rules.mesh_axes('layers') else setup.options.microbatches

  def gradients_and_stats(params, tokens_BL1):
    if (setup.rules.mesh_axes('layers') and
        setup.options.pipeline_schedule in pipeline.SELF_DIFFERENTIATING):
      return one_f_one_b_gradients(setup, ops, params, tokens_BL1)
    # Packed documents: every micro-batch's loss divides by the whole batch's kept count.
    count = kept_count(ops, tokens_BL1, eos_id, accumulated)
    (loss, stats), grads = accumulate_gradients(
        jax.value_and_grad(lambda p, t: loss_fn(p, t, count), has_aux=True), params,
        tokens_BL1, accumulated,
        lambda micro: jax.lax.with_sharding_constraint(micro, micro_batches))
    return loss, grads, stats

  def gradients(params, tokens_BL1):
    return gradients_and_stats(params, tokens_BL1)[:2]

  moment_shardings = sharding.named(setup.mesh, setup.moment_specs())

  def train_step(state, tokens_BL1):
    loss, grads, stats = gradients_and_stats(state['params'], tokens_BL1)
    grads = trainable_only(setup.model, grads)
    if setup.options.optimizer_sharding == 'zero1':
      # Laid out as the moments, so that the update runs on each device's slice and the
      # parameters' layout (out_shardings) all-gathers the updated slices. XLA still all-reduces
      # the gradients and slices them (docs/parallelism.md); manual mode reduce-scatters.
      grads = jax.lax.with_sharding_constraint(grads, moment_shardings)
    return apply_update(setup, state, loss, grads, optax.tree.norm(grads), stats)

  rows = NamedSharding(setup.mesh, P(batch.spec[0]))  # [B], split like the windows.
  return Steps(
      train=jax.jit(optimizer_on_device(setup, train_step), in_shardings=(state_shardings, batch),
                    out_shardings=(state_shardings, replicated), donate_argnums=0),
      eval=jax.jit(lambda params, tokens_BL1: next_token_loss(
          params, setup.graphdef, tokens_BL1, ops, with_aux=False, eos_id=eos_id,
          loss_chunks=setup.options.loss_chunks),
                   in_shardings=(params_shardings, batch), out_shardings=replicated),
      gradients=jax.jit(gradients, in_shardings=(params_shardings, batch),
                        out_shardings=(replicated, params_shardings)),
      window_losses=jax.jit(lambda params, tokens_BL1: window_losses(
          params, setup.graphdef, tokens_BL1, ops, eos_id),
                            in_shardings=(params_shardings, batch), out_shardings=(rows, rows)))
