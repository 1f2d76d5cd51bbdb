"""The laid-out model (engine.validation's `check_layout`): every parameter's split, once the
shapes are known, before anything compiles."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from engine import muon, sharding
from engine.errors import ConfigError


def check_layout(train_setup) -> None:
  """The laid-out model (engine.state.TrainSetup), once its shapes are known: every split
  dimension of every parameter divides over its mesh axes, and a context axis meets a model
  that reads positions through `ops`. Any model's sizes are checked here, before anything
  compiles."""
  mesh_shape = dict(train_setup.mesh.shape)
  for p in train_setup.parameters():
    for dim, (size, name, entry) in enumerate(zip(p.shape, p.logical_axes, p.spec)):
      axes = sharding.spec_axes(P(entry))
      ways = math.prod(mesh_shape[a] for a in axes)
      if size % ways:
        raise ConfigError(
            f'Parameter {p.path} {p.shape}: dimension {dim} ({name!r}, size {size}) is split '
            f'{ways} ways over mesh axes {axes}, which does not divide it; choose model sizes '
            f'that the mesh divides, or rules (parallelism.rules) that do not split {name!r}.')
  model = train_setup.model
  if mesh_shape['context'] > 1 and not model.context_parallel:
    raise ConfigError(
        f'mesh.context={mesh_shape["context"]}: model {model.name!r} does not support context '
        'parallelism (its ModelSpec has context_parallel=False); set mesh.context=1.')
  optimizer = train_setup.optimizer
  if optimizer.build is not None and not any(
      d is not None for d in jax.tree.leaves(optimizer.matrix_dims, is_leaf=muon.is_dims)):
    raise ConfigError(
        f"optim.name='muon': model {model.name!r} has no parameter Muon takes (a matrix whose "
        'dimensions are all named embed, heads, kv_heads, head_dim, mlp or latent, beside '
        "stacked layers or experts: engine/muon.py); use optim.name='adamw'.")
  if train_setup.options.loss_chunks > 1 and not model.separable_head:
    raise ConfigError(
        f'model.loss_chunks={train_setup.options.loss_chunks}: model {model.name!r} computes its '
        'logits in one call (its ModelSpec has separable_head=False); set model.loss_chunks=1.')
