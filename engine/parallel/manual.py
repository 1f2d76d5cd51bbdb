"""Manual mode: the whole train step inside `jax.shard_map`, every collective written here.

The collectives come from the same rules that give auto mode its shardings:

- A parameter dimension whose logical name maps to mesh axes in the parameter rules but not in
  the activation rules (FSDP's `embed` -> fsdp) is `all_gather`ed before use: a stacked layer's
  parameters when that layer starts (`ops.layer`, inside the layer scan and under remat, so only
  one layer's gathered weights are alive at a time and the backward pass gathers again), every
  other parameter once before the model runs. The transpose of the gather is a `psum_scatter`:
  the gradient arrives reduce-scattered. The model reads parameters the plain Flax way.
- A contraction over a dimension that the activation rules shard (Megatron's row-parallel
  attention-out and MLP-down over `heads` / `mlp` -> tensor) ends with a `psum` over those axes.
  Its column-parallel partner needs nothing in the forward pass; JAX's varying-axes types turn the
  broadcast of the replicated activation into the backward `psum`.
- A vocabulary sharded over `tensor` gets a vocab-parallel embedding lookup (masked local lookup,
  `psum`) and a vocab-parallel cross-entropy (`pmax` / `psum` of the logsumexp terms).
- Gradients follow the pattern in DESIGN.md ("the gradient trap"): each parameter is cast to
  varying over the batch axes it is replicated on, the gradient is taken with respect to that
  local copy, and one explicit `pmean` over those axes averages it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine.models.ops import LocalOps
from engine.parallel.steps import Steps, apply_update, map_params, next_token_loss
from engine.sharding import Rules, named, spec_axes
from engine.state import TrainSetup


def _not_gathered(prim, *_, **__) -> bool:
  """Remat policy: keep everything for the backward pass except gathered parameters."""
  return prim.name != 'all_gather'


class ManualOps(LocalOps):
  """The model's layout hooks, written with explicit collectives on local shards."""

  def __init__(self, rules: Rules, mesh_shape: dict[str, int]):
    self.rules = rules
    self.mesh_shape = mesh_shape

  def _gathered(self, value: jax.Array, logical_axes) -> jax.Array:
    for dim, logical in enumerate(logical_axes):
      axes = self.rules.gather_axes(logical)
      if axes:
        value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
    return value

  def prepare_params(self, module, skip_stacked=True):
    return map_params(module, self._gathered, skip_stacked)

  def layer(self, fn):
    # The layer's weights are gathered inside remat and not saved for the backward pass: peak
    # memory holds one layer's full parameters, and the backward pass gathers them again.
    def gathered_layer(layer, *args):
      return fn(self.prepare_params(layer, skip_stacked=False), *args)
    return nnx.remat(gathered_layer, policy=_not_gathered)
  def finish_contraction(self, y, contracted):
    axes = self.rules.mesh_axes(contracted, activation=True)
    return jax.lax.psum(y, axes) if axes else y

  def _vocab_shard(self, local_vocab: int):
    """(axes, first id of this device's vocabulary shard) for a vocab split over `tensor`."""
    axes = self.rules.mesh_axes('vocab', activation=True)
    index = 0
    for axis in axes:  # Row-major position of this device among the vocab shards.
      index = index * self.mesh_shape[axis] + jax.lax.axis_index(axis)
    return axes, index * local_vocab

  def embed_lookup(self, table_VD, tokens_BL):
    axes, first = self._vocab_shard(table_VD.shape[0])
    if not axes:
      return super().embed_lookup(table_VD, tokens_BL)
    local_BL = tokens_BL - first
    mine_BL = (local_BL >= 0) & (local_BL < table_VD.shape[0])
    rows_BLD = jnp.take(table_VD, jnp.where(mine_BL, local_BL, 0), axis=0)
    return jax.lax.psum(jnp.where(mine_BL[..., None], rows_BLD, 0), axes)

  def cross_entropy(self, logits_BLV, targets_BL):
    axes, first = self._vocab_shard(logits_BLV.shape[-1])
    if not axes:
      return super().cross_entropy(logits_BLV, targets_BL)
    logits_BLV = logits_BLV.astype(jnp.float32)
    # The max only stabilises the exponentials; it needs no gradient.
    max_BL = jax.lax.pmax(jax.lax.stop_gradient(logits_BLV.max(-1)), axes)
    sum_exp_BL = jax.lax.psum(jnp.exp(logits_BLV - max_BL[..., None]).sum(-1), axes)
    local_BL = targets_BL - first
    mine_BL = (local_BL >= 0) & (local_BL < logits_BLV.shape[-1])
    target_logit_BL = jnp.take_along_axis(
        logits_BLV, jnp.where(mine_BL, local_BL, 0)[..., None], axis=-1)[..., 0]
    target_logit_BL = jax.lax.psum(jnp.where(mine_BL, target_logit_BL, 0.0), axes)
    return (jnp.log(sum_exp_BL) + max_BL - target_logit_BL).mean()


def build_steps(setup: TrainSetup) -> Steps:
  mesh_shape = dict(setup.mesh.shape)
  ops = ManualOps(setup.rules, mesh_shape)
  state_specs = setup.state_specs()
  param_specs = state_specs['params']
  batch_spec = setup.batch_sharding().spec
  batch_axes = setup.rules.mesh_axes('batch', activation=True)

  # Per parameter: the batch axes it is replicated over (cast to varying, then pmean), and the
  # factor that turns the psum_scatter of a gathered dimension into a mean over batch shards.
  def replicated_batch_axes(spec):
    return tuple(a for a in batch_axes if a not in spec_axes(spec))

  def scatter_mean_factor(spec):
    return math.prod(mesh_shape[a] for a in batch_axes if a in spec_axes(spec))

  def local_loss(params, tokens_BL1):
    return next_token_loss(params, setup.graphdef, tokens_BL1, ops)

  def gradients(params, tokens_BL1):
    local_params = jax.tree.map(
        lambda p, spec: _cast_to_varying(p, replicated_batch_axes(spec)), params, param_specs)
    loss, grads = jax.value_and_grad(local_loss)(local_params, tokens_BL1)
    grads = jax.tree.map(
        lambda g, spec: _average_over_batch(g, replicated_batch_axes(spec),
                                            scatter_mean_factor(spec)),
        grads, param_specs)
    return jax.lax.pmean(loss, batch_axes) if batch_axes else loss, grads

  def global_norm(grads):
    # Each shard's squared norm is summed over the axes that split that parameter.
    squares = jax.tree.map(
        lambda g, spec: _psum_if(jnp.sum(jnp.square(g.astype(jnp.float32))), spec_axes(spec)),
        grads, param_specs)
    return jnp.sqrt(sum(jax.tree.leaves(squares)))

  def train_step(state, tokens_BL1):
    loss, grads = gradients(state['params'], tokens_BL1)
    return apply_update(setup, state, loss, grads, global_norm(grads))

  def eval_step(params, tokens_BL1):
    loss = local_loss(params, tokens_BL1)
    return jax.lax.pmean(loss, batch_axes) if batch_axes else loss

  def shard_mapped(fn, in_specs, out_specs, donate=False):
    """fn on local shards inside shard_map, jitted with the matching global shardings."""
    return jax.jit(jax.shard_map(fn, mesh=setup.mesh, in_specs=in_specs, out_specs=out_specs),
                   in_shardings=named(setup.mesh, in_specs),
                   out_shardings=named(setup.mesh, out_specs),
                   donate_argnums=0 if donate else ())

  return Steps(
      train=shard_mapped(train_step, (state_specs, batch_spec), (state_specs, P()), donate=True),
      eval=shard_mapped(eval_step, (param_specs, batch_spec), P()),
      gradients=shard_mapped(gradients, (param_specs, batch_spec), (P(), param_specs)))


def _average_over_batch(grad, replicated_axes, scatter_factor):
  """One explicit pmean over the batch axes the parameter is replicated on; gathered batch axes
  already summed their shards' gradients in the psum_scatter, so divide by their size."""
  if replicated_axes:
    grad = jax.lax.pmean(grad, replicated_axes)
  return grad / scatter_factor if scatter_factor > 1 else grad


def _cast_to_varying(param, axes):
  """A local copy of a parameter replicated over `axes`, so its gradient stays local."""
  return jax.lax.pcast(param, axes, to='varying') if axes else param


def _psum_if(x, axes):
  return jax.lax.psum(x, axes) if axes else x
