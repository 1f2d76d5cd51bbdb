"""Building blocks the engine's own models share: parameters named in Flax's metadata, and a
stack of identical layers created with `nnx.vmap` and applied with `nnx.scan`.

Stacking adds the leading LAYERS logical axis to every parameter of the layer; scanning removes
it again inside the loop, and `ops.layer` prepares each layer's parameters there. Compile time
does not grow with depth.
"""

from __future__ import annotations

import math
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


def dense(x: jax.Array, w: jax.Array, in_dims: int = 1, preferred_element_type=None):
  """x [..., *in] times w [*in, *out] -> [..., *out], as one 2-D matrix product.

  `jnp.einsum('BLD,DF->BLF', ...)` computes the same, but XLA:CPU lays out the weight gradient
  of an einsum with two free dimensions on x (batch, length) behind a strided transpose of the
  output gradient; flattening them first ran a Llama MLP's forward and backward 2x faster
  (BUILD.md, "Benchmarks"). Reshapes of leading and trailing dimensions are free on
  every backend and keep each dimension's sharding.
  """
  lead, contracted, out = x.shape[:x.ndim - in_dims], x.shape[x.ndim - in_dims:], w.shape[in_dims:]
  if w.shape[:in_dims] != contracted:
    raise ValueError(f'dense: x {x.shape} and w {w.shape} disagree on the {in_dims} '
                     'contracted dimensions')
  y = jnp.dot(x.reshape(math.prod(lead), math.prod(contracted)),
              w.reshape(math.prod(contracted), math.prod(out)),
              preferred_element_type=preferred_element_type)
  return y.reshape(*lead, *out)


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

  return ops.stack(run, layers, x)
