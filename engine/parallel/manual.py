"""Manual mode: the whole train step inside `jax.shard_map`, every collective written here.

The collectives come from the same rules that give auto mode its shardings:

- A parameter dimension whose logical name maps to mesh axes in the parameter rules but not in
  the activation rules (FSDP's `embed` -> fsdp) is `all_gather`ed just before use, inside the
  layer scan and under remat, so only one layer's gathered weights are alive at a time and the
  backward pass gathers again. The transpose of the gather is a `psum_scatter`: the gradient
  arrives reduce-scattered.
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
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine.parallel.ops import LocalOps
from engine.parallel.steps import Steps
from engine.sharding import Rules, logical_axes_of
from engine.state import StateLayout, clip_by_global_norm, next_token_loss


def _spec_axes(spec: P) -> tuple[str, ...]:
  """Mesh axes that a PartitionSpec splits over, in order."""
  axes = []
  for entry in spec:
    axes += [entry] if isinstance(entry, str) else list(entry or ())
  return tuple(axes)


def _not_gathered(prim, *_, **__) -> bool:
  """Remat policy: keep everything for the backward pass except gathered parameters."""
  return prim.name != 'all_gather'


class ManualOps(LocalOps):
  """The model's layout hooks, written with explicit collectives on local shards."""

  def __init__(self, rules: Rules, mesh_shape: dict[str, int]):
    self.rules = rules
    self.mesh_shape = mesh_shape

  def param(self, variable: nnx.Variable) -> jax.Array:
    value = variable[...]
    for dim, logical in enumerate(logical_axes_of(variable)):
      axes = self.rules.gather_axes(logical)
      if axes:
        value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
    return value

  def layer(self, fn):
    # Under remat the gathered weights are not saved for the backward pass: peak memory holds
    # one layer's full parameters, and the backward pass gathers them again.
    return nnx.remat(fn, policy=_not_gathered)

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


def build_steps(layout: StateLayout) -> Steps:
  mesh_shape = dict(layout.mesh.shape)
  ops = ManualOps(layout.rules, mesh_shape)
  state_specs = layout.state_specs()
  batch_spec = layout.rules.spec(('batch', None), activation=True)
  batch_axes = layout.rules.mesh_axes('batch', activation=True)

  # Per parameter: the batch axes it is replicated over (cast to varying, then pmean), and the
  # factor that turns the psum_scatter of a gathered dimension into a mean over batch shards.
  def replicated_batch_axes(spec):
    return tuple(a for a in batch_axes if a not in _spec_axes(spec))

  def scatter_mean_factor(spec):
    return math.prod(mesh_shape[a] for a in batch_axes if a in _spec_axes(spec))

  param_specs = layout.param_specs

  def local_loss(params, tokens_BL1):
    return next_token_loss(params, layout.graphdef, tokens_BL1, ops)

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
        lambda g, spec: _psum_if(jnp.sum(jnp.square(g.astype(jnp.float32))), _spec_axes(spec)),
        grads, param_specs)
    return jnp.sqrt(sum(jax.tree.leaves(squares)))

  def train_step(state, tokens_BL1):
    loss, grads = gradients(state['params'], tokens_BL1)
    grad_norm = global_norm(grads)
    grads = clip_by_global_norm(grads, grad_norm, layout.max_grad_norm)
    updates, opt_state = layout.tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = {'loss': loss, 'grad_norm': grad_norm}
    return {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state}, metrics

  def eval_step(params, tokens_BL1):
    loss = local_loss(params, tokens_BL1)
    return jax.lax.pmean(loss, batch_axes) if batch_axes else loss

  state_shardings = layout.state_shardings()
  batch_sharding = jax.sharding.NamedSharding(layout.mesh, batch_spec)
  replicated_sharding = jax.sharding.NamedSharding(layout.mesh, P())
  train = jax.shard_map(train_step, mesh=layout.mesh, in_specs=(state_specs, batch_spec),
                        out_specs=(state_specs, P()))
  evaluate = jax.shard_map(eval_step, mesh=layout.mesh,
                           in_specs=(state_specs['params'], batch_spec), out_specs=P())
  return Steps(
      train=jax.jit(train, in_shardings=(state_shardings, batch_sharding),
                    out_shardings=(state_shardings, replicated_sharding), donate_argnums=0),
      eval=jax.jit(evaluate, in_shardings=(state_shardings['params'], batch_sharding),
                   out_shardings=replicated_sharding))


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
