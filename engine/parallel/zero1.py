"""ZeRO-1 in manual mode (parallelism.optimizer_sharding='zero1'): the optimizer's moments split over
the batch axes their parameter is replicated on, and the collectives that keep them so.

TrainSetup.moment_specs lays each moment out as its parameter plus those batch axes (`extra`) on
one dimension (engine.sharding.split_further). Inside the step each device then:

- reduce-scatters every gradient over `extra` along that dimension (psum_scatter), and sums it
  over the rest of the batch axes it is replicated on, in parallelism.grad_reduce_dtype: its
  block of the batch mean, where data parallelism alone would have pmeaned the whole gradient;
- updates its block of the parameter with its block of the moments (parameter_block);
- all-gathers the updated blocks over `extra` into the whole parameter (whole_parameter).

A parameter no dimension of which divides by `extra` keeps whole moments: its gradient is
pmeaned, as without ZeRO-1. Shape-independent: `extra` and the dimension come from the specs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax._src.lax.parallel import all_gather_invariant  # Public in later JAX releases.
from jax.sharding import PartitionSpec as P

from engine.sharding import spec_axes


def _entry_axes(entry) -> tuple[str, ...]:
  return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def split(param_spec: P, moment_spec: P) -> tuple[tuple[str, ...], int]:
  """(the axes the moment is split over beyond its parameter, the dimension they split): ((), -1)
  where the moment is laid out as the parameter."""
  stored = set(spec_axes(param_spec))
  for dim, entry in enumerate(moment_spec):
    extra = tuple(a for a in _entry_axes(entry) if a not in stored)
    if extra:
      return extra, dim
  return (), -1


def reduced_gradient(grad, param_spec: P, moment_spec: P, replicated, scatter_factor: int,
                     mesh_shape: dict, reduce_dtype) -> jax.Array:
  """The batch mean of a gradient taken w.r.t. a local copy of its parameter, reduced to this
  device's block of the moment: psum_scatter over the moment's extra axes, psum over the other
  batch axes the parameter is `replicated` on, divided by all of them and by `scatter_factor`,
  the batch axes that split the parameter (its FSDP gather's transpose already summed over
  those; ManualOps.spec_reduction gives both). Float32."""
  extra, dim = split(param_spec, moment_spec)
  grad = grad.astype(reduce_dtype)
  if extra:
    grad = jax.lax.psum_scatter(grad, extra, scatter_dimension=dim, tiled=True)
  rest = tuple(a for a in replicated if a not in extra)
  if rest:
    grad = jax.lax.psum(grad, rest)
  count = math.prod(mesh_shape[a] for a in replicated) * scatter_factor
  return grad.astype(jnp.float32) / count


def parameter_block(param, param_spec: P, moment_spec: P, ops) -> jax.Array:
  """This device's block of a (local) parameter, laid out as its moments (`ops`: the step's
  ManualOps, for the mesh and this device's position on it)."""
  extra, dim = split(param_spec, moment_spec)
  if not extra:
    return param
  size = param.shape[dim] // math.prod(ops.mesh_shape[a] for a in extra)
  return jax.lax.dynamic_slice_in_dim(param, ops.shard_index(extra) * size, size, dim)


def whole_parameter(block, param_spec: P, moment_spec: P) -> jax.Array:
  """The (local) parameter from every device's updated block: all-gathered over the extra axes,
  typed invariant over them (the parameter leaves the step replicated there)."""
  extra, dim = split(param_spec, moment_spec)
  return all_gather_invariant(block, extra, axis=dim, tiled=True) if extra else block
