"""Building blocks the engine's own models share: parameters named in Flax's metadata, and a
stack of identical layers created with `nnx.vmap` and applied with `nnx.scan`.

Stacking adds the leading LAYERS logical axis to every parameter of the layer; scanning removes
it again inside the loop, and `ops.layer` prepares each layer's parameters there. Compile time
does not grow with depth.

A circular pipeline (train.pipeline_repeats = R > 1) needs the stack in R consecutive groups:
`group_layers` reshapes every stacked parameter [L, ...] to [R, L / R, ...] (logical axes
REPEATS, LAYERS, ...), the same values in the same order, so that splitting LAYERS over stages
gives each stage one slice of every group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models import dense_taps, quantized_matmul

# The logical name of the axis that stacks layers (nnx.vmap / nnx.scan with
# transform_metadata={nnx.PARTITION_NAME: LAYERS}). Parameters with this axis are prepared one
# layer at a time, inside `ops.layer`; all others once, before the model runs.
LAYERS = 'layers'
# The axis of a stack's groups (group_layers), ahead of LAYERS.
REPEATS = 'repeats'
# The axis of a short stack that runs before the LAYERS stack, outside it (a mixture of experts'
# dense first layers): no rule splits it, and its parameters are prepared with the model's.
FIRST_LAYERS = 'first_layers'

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


def dense(x: jax.Array, w: jax.Array, in_dims: int = 1, preferred_element_type=None,
          precision: quantized_matmul.MatmulPrecision = quantized_matmul.DEFAULT):
  """x [..., *in] times w [*in, *out] -> [..., *out], as one 2-D matrix product.

  `jnp.einsum('BLD,DF->BLF', ...)` computes the same, but XLA:CPU lays out the weight gradient
  of an einsum with two free dimensions on x (batch, length) behind a strided transpose of the
  output gradient; flattening them first ran a Llama MLP's forward and backward faster
  (docs/benchmarks.md). Reshapes of leading and trailing dimensions are free on
  every backend and keep each dimension's sharding. `precision` quantizes the product
  (engine/models/quantized_matmul.py), forward and backward.
  """
  lead, contracted, out = x.shape[:x.ndim - in_dims], x.shape[x.ndim - in_dims:], w.shape[in_dims:]
  if w.shape[:in_dims] != contracted:
    raise ValueError(f'dense: x {x.shape} and w {w.shape} disagree on the {in_dims} '
                     'contracted dimensions')

  def matmul(x, w):
    x_NK = x.reshape(math.prod(lead), math.prod(contracted))
    w_KF = w.reshape(math.prod(contracted), math.prod(out))
    if precision.quantized:
      y = quantized_matmul.matmul(x_NK, w_KF, precision)
    else:
      y = jnp.dot(x_NK, w_KF, preferred_element_type=preferred_element_type)
    return y.reshape(*lead, *out)

  # Inside a layer stack split into input- and weight-gradient passes, as they need it.
  return dense_taps.dense_call(x, w, matmul)


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
                 rngs: nnx.Rngs, axis: str = LAYERS) -> nnx.Module:
  """`num_layers` independently initialised layers, stacked along a leading `axis`."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
  def make(rngs):
    return make_layer(rngs)

  return make(rngs)


def apply_layers(layers: nnx.Module, x: jax.Array, ops, unroll: int = 1) -> jax.Array:
  """x through every stacked layer in order (`layer(x, ops)`), `unroll` layers per loop
  iteration (the number of layers writes the loop out in the HLO: debugging).

  The stack hands `ops.stack` a `run(layers, x, documents, taps=None)`; with `taps`
  (engine/models/dense_taps.py, values stacked per layer) it returns (x, what the taps' mode
  returns per dense call, stacked per layer)."""

  @nnx.scan(in_axes=(0, nnx.Carry, None, 0), out_axes=(nnx.Carry, 0),
            transform_metadata=_LAYER_AXIS, unroll=unroll)
  def scanned(layer, x, documents, taps):
    # Packed documents (ops.documents; a pipeline passes each micro-batch's) and the taps
    # arrive as arguments: a scan body reused by several calls would keep the tracers it first
    # closed over.
    layer_ops = ops if documents is None else ops.with_documents(*documents)
    apply = lambda layer, x: layer(x, layer_ops)
    if taps is None:
      return ops.layer(apply)(layer, x), ()
    return ops.layer(dense_taps.tapped(apply))(layer, x, taps)

  def run(layers, x, documents, taps=None):
    y, returned = scanned(layers, x, documents, taps)
    return y if taps is None else (y, returned)

  return ops.stack(run, layers, x)


def _stacked_axes(variable: nnx.Variable) -> tuple:
  return tuple(variable.get_metadata().get('out_sharding') or ())


def group_layers(module: nnx.Module, repeats: int) -> nnx.Module:
  """`module` with every stacked parameter [L, ...] reshaped in place to [repeats, L / repeats,
  ...]: layer r * L / repeats + i is layer i of group r."""
  if repeats == 1:
    return module
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Variable) and _stacked_axes(node)[:1] == (LAYERS,):
      value = node.get_value()
      if value.shape[0] % repeats:
        raise ValueError(f'{value.shape[0]} stacked layers do not form {repeats} equal groups')
      node.set_value(value.reshape(repeats, value.shape[0] // repeats, *value.shape[1:]))
      node.set_metadata(out_sharding=(REPEATS,) + _stacked_axes(node))
  return module


def num_groups(layers: nnx.Module) -> int:
  """How many groups `group_layers` made of this stack (1: not grouped)."""
  for variable in jax.tree.leaves(nnx.state(layers), is_leaf=lambda x: isinstance(x, nnx.Variable)):
    if _stacked_axes(variable)[:1] == (REPEATS,):
      return variable.get_value().shape[0]
  return 1


def layer_group(layers: nnx.Module, index) -> nnx.Module:
  """Group `index` (an int, or a traced integer) of a grouped stack: a plain stack of L / R
  layers."""
  graphdef, state = nnx.split(layers)

  def pick(variable):
    axes = _stacked_axes(variable)
    if axes[:1] != (REPEATS,):
      return variable
    value = variable.get_value()
    if isinstance(index, int):
      value = value[index]
    else:
      value = jax.lax.dynamic_index_in_dim(value, index, 0, keepdims=False)
    return variable.replace(value, out_sharding=axes[1:])

  return nnx.merge(graphdef, jax.tree.map(pick, state,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable)))


def one_layer(layers: nnx.Module, index: int, axis: str = LAYERS) -> nnx.Module:
  """Layer `index` of a plain stack along `axis`, unstacked, as `nnx.scan` hands each layer to
  its body (generation applies layers one at a time)."""
  graphdef, state = nnx.split(layers)

  def pick(variable):
    axes = _stacked_axes(variable)
    if axes[:1] != (axis,):
      return variable
    return variable.replace(variable.get_value()[index], out_sharding=axes[1:])

  return nnx.merge(graphdef, jax.tree.map(pick, state,
                                          is_leaf=lambda x: isinstance(x, nnx.Variable)))
