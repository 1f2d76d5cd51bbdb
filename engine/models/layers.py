"""Building blocks the engine's own models share: parameters named in Flax's metadata, and a
stack of identical layers created with `nnx.vmap` and applied with `nnx.scan`.

Stacking adds the leading LAYERS logical axis to every parameter of the layer; scanning removes
it again inside the loop, and `ops.layer` prepares each layer's parameters there. Compile time
does not grow with depth.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.ops import LAYERS

_LAYER_AXIS = {nnx.PARTITION_NAME: LAYERS}


def param(rngs: nnx.Rngs, shape, logical_axes, std: float | None) -> nnx.Param:
  """A parameter initialised N(0, std) (or ones / zeros for std=None / 0), its dimensions named
  in Flax's `out_sharding` metadata."""
  if std is None:
    value = jnp.ones(shape, jnp.float32)
  elif std == 0:
    value = jnp.zeros(shape, jnp.float32)
  else:
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value, out_sharding=tuple(logical_axes))


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                 rngs: nnx.Rngs) -> nnx.Module:
  """`num_layers` independently initialised layers, stacked along a leading LAYERS axis."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_AXIS)
  def make(rngs):
    return make_layer(rngs)

  return make(rngs)


def apply_layers(layers: nnx.Module, x: jax.Array, ops, unroll: int = 1) -> jax.Array:
  """x through every stacked layer in order (`layer(x, ops)`), `unroll` layers per loop
  iteration (the number of layers writes the loop out in the HLO: debugging)."""

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata=_LAYER_AXIS,
            unroll=unroll)
  def run(layer, x):
    return ops.layer(lambda layer, x: layer(x, ops))(layer, x)

  return run(layers, x)
