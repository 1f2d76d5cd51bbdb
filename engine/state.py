"""The train state: optimizer, objective, abstract state and its shardings, sharded creation.

The state is a plain pytree `{'step', 'params', 'opt_state'}` with params as a nested dict of
arrays, so Orbax saves and restores it and both parallel modes share it unchanged. The model's
graph definition (structure + logical-axis metadata) stays outside, in `StateLayout`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from engine import sharding
from engine.sharding import Rules


def learning_rate_schedule(optim_config, num_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to `end_learning_rate`.

  The decay ends at `decay_steps` (warmup included), by default the end of training; a run
  shorter than its warmup simply never leaves it."""
  decay_steps = optim_config.decay_steps if optim_config.decay_steps > 0 else num_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim_config.learning_rate,
      warmup_steps=optim_config.warmup_steps,
      decay_steps=max(decay_steps, optim_config.warmup_steps + 1),
      end_value=optim_config.end_learning_rate)


def make_optimizer(optim_config, num_steps: int) -> optax.GradientTransformation:
  """AdamW; weight decay only on matrices (not norms or biases).

  Global-norm clipping happens in the train step (`clip_by_global_norm`), not in this chain: in
  manual mode the norm of sharded gradients needs collectives that only the step can write, and
  keeping it out of the chain gives both modes the same optimizer state, so checkpoints move
  between them.
  """
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.adamw(learning_rate_schedule(optim_config, num_steps), b1=optim_config.b1,
                     b2=optim_config.b2, weight_decay=optim_config.weight_decay, mask=decay_mask)


def clip_by_global_norm(grads, global_norm: jax.Array, max_norm: float):
  """Scales gradients down to `max_norm` when their global norm exceeds it (optax's formula)."""
  scale = jnp.where(global_norm < max_norm, 1.0, max_norm / global_norm)
  return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


def next_token_loss(params, graphdef: nnx.GraphDef, tokens_BL1: jax.Array, ops) -> jax.Array:
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
  model = nnx.merge(graphdef, params)
  logits_BLV = model(tokens_BL1[:, :-1], ops)
  return ops.cross_entropy(logits_BLV, tokens_BL1[:, 1:])


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
  path: str  # '/'-joined, e.g. 'blocks/w_up_DF'.
  shape: tuple[int, ...]
  logical_axes: tuple[str | None, ...]
  spec: P
  shard_shape: tuple[int, ...]
  bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Everything needed to build, shard and apply the train state, derived without allocating."""
  model_factory: Callable[[nnx.Rngs], nnx.Module]
  graphdef: nnx.GraphDef
  abstract_params: Any  # nested dict of ShapeDtypeStruct
  param_specs: Any  # nested dict of PartitionSpec, same structure
  tx: optax.GradientTransformation
  max_grad_norm: float
  mesh: jax.sharding.Mesh
  rules: Rules

  def parameters(self) -> list[ParameterInfo]:
    """Every parameter with its logical axes, PartitionSpec and per-device size, by path."""
    graph_state = nnx.state(nnx.merge(self.graphdef, self.abstract_params))
    infos = []
    for path, variable in nnx.to_flat_state(graph_state):
      value = variable.get_value()
      axes = sharding.logical_axes_of(variable)
      spec = self.rules.spec(axes)
      shard = NamedSharding(self.mesh, spec).shard_shape(value.shape)
      infos.append(ParameterInfo('/'.join(map(str, path)), tuple(value.shape), axes, spec,
                                 tuple(shard), math.prod(shard) * value.dtype.itemsize))
    return infos

  def state_specs(self):
    """PartitionSpecs of the whole train state; optimizer moments follow their parameters."""
    abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
    opt_specs = optax.tree_map_params(
        self.tx, lambda _, spec: spec, abstract_opt, self.param_specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
    return {'step': P(), 'params': self.param_specs, 'opt_state': opt_specs}

  def state_shardings(self):
    return sharding.named(self.mesh, self.state_specs())

  def abstract_state(self):
    """ShapeDtypeStructs carrying their target shardings: the restore target for Orbax."""
    shapes = jax.eval_shape(lambda: self._fresh_state(jax.random.key(0)))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings())

  def _fresh_state(self, key):
    model = self.model_factory(nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {'step': jnp.zeros((), jnp.int32), 'params': params,
            'opt_state': self.tx.init(params)}

  def init(self, seed: int):
    """Creates the state already sharded; returns (state, compiled init) for its memory stats."""
    return sharding.sharded_init(
        lambda: self._fresh_state(jax.random.key(seed)),
        self.state_shardings())


def make_layout(model_factory: Callable[[nnx.Rngs], nnx.Module], tx, max_grad_norm: float, mesh,
                rules) -> StateLayout:
  graphdef, abstract = sharding.abstract_model(model_factory)
  specs = sharding.variable_specs(abstract, rules)
  return StateLayout(
      model_factory=model_factory, graphdef=graphdef,
      abstract_params=nnx.to_pure_dict(abstract), param_specs=nnx.to_pure_dict(specs),
      tx=tx, max_grad_norm=max_grad_norm, mesh=mesh, rules=rules)


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules) -> NamedSharding:
  """Token batches [batch, length+1] are split over the batch axes of the rules."""
  return NamedSharding(mesh, rules.spec(('batch', None), activation=True))
