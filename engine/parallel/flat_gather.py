"""Manual FSDP's gathers, one collective per group of weights (PyTorch FSDP's flat parameter).

A collective costs a fixed latency besides its bytes: every device must reach it (a rendezvous of
all device threads on XLA:CPU, a launch and a handshake on accelerators). A Llama layer has seven
FSDP-split weights; gathered one by one they are seven all-gathers in the forward pass, seven again
in the rematerialised backward pass and, as their transposes, seven reduce-scatters of the
gradients. XLA:CPU combines neither all-gathers nor reduce-scatters (it does combine all-reduces,
which is why auto mode's all-reduced FSDP gradients came out ahead of manual mode's reduce-scatters,
profiled in docs/benchmarks.md). So the weights split over the same mesh axes, in the same dtype,
travel together: their local shards are flattened into one buffer, gathered in one `all_gather`, and
cut back into whole weights. The transpose of that gather is one `psum_scatter` of the layer's
gradients. Same bytes, one collective instead of seven, at the price of a copy of the gathered
weights (the cut, and a transpose for a weight split on a dimension other than its first).

Only where that pays: parallelism.fsdp_gather=auto (engine/assemble.py: flat_gather) groups on CPU
devices. XLA:TPU and XLA:GPU have combiner passes for all-gathers and reduce-scatters of their own;
compiled for TPU v5p (the 8B plan in docs/benchmarks.md) the per-weight gathers needed less memory
and less time on the interconnect than the flat ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

# (dimension, mesh axes it is gathered over) for each FSDP-split dimension of a weight.
Splits = Sequence[tuple[int, tuple[str, ...]]]


def split_dims(rules, logical_axes) -> list[tuple[int, tuple[str, ...]]]:
  """(dimension, mesh axes) for each FSDP-split dimension of a parameter with these logical
  axes under `rules` (engine.sharding.Rules.gather_axes)."""
  return [(dim, axes) for dim, name in enumerate(logical_axes) if (axes := rules.gather_axes(name))]


def gather(value: jax.Array, splits: Splits) -> jax.Array:
  """One weight's split dimensions all-gathered, one dimension at a time."""
  for dim, axes in splits:
    value = jax.lax.all_gather(value, axes, axis=dim, tiled=True)
  return value


def gather_together(values: Sequence[jax.Array], splits: Sequence[Splits],
                    flat: bool = True) -> list[jax.Array]:
  """Every value with its `splits` dimensions all-gathered; with `flat`, those split on one
  dimension over the same axes and of one dtype in a single all_gather; the rest (all, without
  `flat`) one by one (`gather`)."""
  if not flat:
    return [gather(v, split) for v, split in zip(values, splits)]
  out = list(values)
  for i, split in enumerate(splits):
    if len(split) > 1:
      out[i] = gather(values[i], split)
  for (axes, _, _), members in _groups(values, splits).items():
    if len(members) == 1:
      (i,) = members
      out[i] = gather(values[i], splits[i])
      continue
    whole = _gather_flat([values[i] for i in members], [splits[i][0][0] for i in members], axes)
    for i, value in zip(members, whole):
      out[i] = value
  return out


def _groups(values: Sequence[jax.Array], splits: Sequence[Splits]) -> dict[tuple, list[int]]:
  """{(axes, dtype, varying axes): indices of the values split on one dimension over those
  axes}. The varying axes too: a weight concatenated with one that varies over more axes (split
  over `tensor`, say) would come out typed as varying over them as well."""
  groups: dict[tuple, list[int]] = {}
  for i, (value, split) in enumerate(zip(values, splits)):
    if len(split) == 1:
      key = (split[0][1], value.dtype, jax.typeof(value).manual_axis_type)
      groups.setdefault(key, []).append(i)
  return groups


def _gather_flat(values: list[jax.Array], dims: list[int], axes: tuple[str, ...]) -> list:
  """Local shards, each split on dims[i] over `axes`, concatenated flat, gathered into a
  [devices, flat] buffer in one all_gather, and cut back into whole weights."""
  flat = jnp.concatenate([v.reshape(-1) for v in values])
  gathered = jax.lax.all_gather(flat, axes)  # [n, flat]: row j is device j's shards.
  n = gathered.shape[0]
  # A split, not slices: its transpose (the gradient's path) is one concatenation, where the
  # slices' would be a sum of zero-padded copies.
  pieces = jnp.split(gathered, _offsets(values), axis=1)
  whole = []
  for value, dim, piece in zip(values, dims, pieces):
    # Device j holds rows j*s..(j+1)*s of dimension `dim`: put the device index just before
    # that dimension, then merge the two.
    piece = jnp.moveaxis(piece.reshape((n,) + value.shape), 0, dim)
    shape = list(value.shape)
    shape[dim] *= n
    whole.append(piece.reshape(shape))
  return whole


def scatter(grad: jax.Array, splits: Splits) -> jax.Array:
  """The transpose of `gather`: each split dimension summed over its axes and scattered back to
  this device's shard."""
  for dim, axes in splits:
    grad = jax.lax.psum_scatter(grad, axes, scatter_dimension=dim, tiled=True)
  return grad


def scatter_together(grads: Sequence[jax.Array], splits: Sequence[Splits],
                     flat: bool = True) -> list[jax.Array]:
  """The transpose of `gather_together` for gradients of whole weights (grouped the same way):
  one psum_scatter per group where the gather had one all_gather."""
  if not flat:
    return [scatter(g, split) for g, split in zip(grads, splits)]
  out = list(grads)
  for (axes, _, _), members in _groups(grads, splits).items():
    if len(members) == 1:
      out[members[0]] = scatter(grads[members[0]], splits[members[0]])
      continue
    dims = [splits[i][0][0] for i in members]
    for i, shard in zip(members, _scatter_flat([grads[i] for i in members], dims, axes)):
      out[i] = shard
  for i, split in enumerate(splits):
    if len(split) > 1:
      out[i] = scatter(grads[i], split)
  return out


def _scatter_flat(grads: list[jax.Array], dims: list[int], axes: tuple[str, ...]) -> list:
  """`_gather_flat`'s transpose: each whole gradient cut into [devices, shard] rows, all
  concatenated, summed and scattered in one psum_scatter, and cut back into shards."""
  n = math.prod(jax.lax.axis_size(a) for a in axes)
  rows, shapes = [], []
  for grad, dim in zip(grads, dims):
    shape = list(grad.shape)
    shape[dim] //= n
    split = grad.reshape(shape[:dim] + [n] + shape[dim:])
    rows.append(jnp.moveaxis(split, dim, 0).reshape(n, -1))
    shapes.append(shape)
  flat = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axes, scatter_dimension=0)
  return [piece.reshape(shape) for piece, shape in zip(jnp.split(flat, _offsets(shapes)), shapes)]


def _offsets(shapes: list) -> list[int]:
  """Where each but the first of these (arrays or shapes) starts in their flat concatenation."""
  sizes = [math.prod(getattr(s, 'shape', s)) for s in shapes]
  return list(itertools.accumulate(sizes))[:-1]
