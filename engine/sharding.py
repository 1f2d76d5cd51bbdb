"""Logical axis names -> mesh axes (rule presets), state shardings, and sharded initialisation.

Parameters carry logical axis names in Flax's own sharding metadata (`out_sharding`, as
`nnx.with_partitioning` writes it); activations are annotated with logical names in the model.
A `Rules` object maps both to mesh axes. Parameters and activations have separate tables because
FSDP shards a parameter's `embed` dimension while the activations' `embed` dimension stays whole:
that difference is exactly what manual mode gathers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

MeshAxes = tuple[str, ...]
# Flax's metadata key for a Variable's dimension names (nnx.with_partitioning writes it). The
# engine reads the names as logical axes and maps them through its rules.
LOGICAL_AXES = 'out_sharding'


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical name -> mesh axes, for parameters and for activations."""
  params: Mapping[str, MeshAxes]
  activations: Mapping[str, MeshAxes]

  def mesh_axes(self, logical: str | None, activation: bool = False) -> MeshAxes:
    table = self.activations if activation else self.params
    return tuple(table.get(logical, ())) if logical else ()

  def spec(self, logical_axes: tuple[str | None, ...], activation: bool = False) -> P:
    """PartitionSpec for a tensor whose dimensions have these logical names."""
    dims = []
    for name in logical_axes:
      axes = self.mesh_axes(name, activation)
      dims.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*dims)

  def gather_axes(self, logical: str | None) -> MeshAxes:
    """Mesh axes over which a parameter dimension is stored split but computed whole (FSDP):
    manual mode all-gathers the dimension over them before use. Pipeline stages (`layers`) are
    never gathered: each stage computes only its own layers."""
    if logical == 'layers':
      return ()
    kept = self.mesh_axes(logical, activation=True)
    return tuple(a for a in self.mesh_axes(logical) if a not in kept)

  def mesh_axes_used(self) -> set[str]:
    used = set()
    for table in (self.params, self.activations):
      for axes in table.values():
        used.update(axes)
    return used

  def replicating(self, logical: str) -> Rules:
    """These rules with `logical` split over no mesh axis, in parameters and activations."""
    drop = lambda table: {k: v for k, v in table.items() if k != logical}
    return Rules(drop(self.params), drop(self.activations))

  def restricted_to(self, mesh_shape: Mapping[str, int]) -> Rules:
    """Drops mesh axes of size 1: the mesh shape picks which parts of a preset apply."""
    keep = lambda table: {k: tuple(a for a in v if mesh_shape.get(a, 1) > 1)
                          for k, v in table.items()}
    return Rules(keep(self.params), keep(self.activations))


# The combined layout: batch over data, fsdp and expert; parameters' embed over fsdp (ZeRO-3);
# heads / MLP hidden / vocabulary over tensor (Megatron); the sequence (activations' `length`)
# over context; stacked layers over stage (pipeline); a mixture of experts' `experts` over expert.
# Other presets are its restrictions. `experts` is in both tables, so it is stored and computed
# split (gather_axes never gathers it, unlike FSDP's embed); the router's expert dimension is
# unnamed, so the router stays whole on every device. Expert parallelism borrows data-parallel
# ranks: `expert` ends every `batch`, so the dense layers see it as more data parallelism, and
# `expert_groups` (the group dimension of tokens dispatched to experts, [E, G, C, D]) is the batch
# without it, as a PartitionSpec may name `expert` only once.
_TENSOR_NAMES = ('heads', 'kv_heads', 'mlp', 'vocab')
_CONTEXT = {'length': ('context',)}
_STAGE = {'layers': ('stage',)}  # Stacked layers split into pipeline stages.
_EXPERT = {'experts': ('expert',)}


def _batch(*axes: str) -> dict[str, MeshAxes]:
  """The activations' batch over `axes` and expert; expert_groups over `axes` alone."""
  return {'batch': (*axes, 'expert'), 'expert_groups': axes}


RULE_PRESETS: dict[str, Rules] = {
    'data_parallel': Rules(params={**_STAGE, **_EXPERT},
                           activations={**_batch('data'), **_CONTEXT, **_EXPERT}),
    'fsdp': Rules(params={'embed': ('fsdp',), **_STAGE, **_EXPERT},
                  activations={**_batch('data', 'fsdp'), **_CONTEXT, **_EXPERT}),
    'tensor': Rules(params={**{n: ('tensor',) for n in _TENSOR_NAMES}, **_STAGE, **_EXPERT},
                    activations={**_batch('data'), **{n: ('tensor',) for n in _TENSOR_NAMES},
                                 **_CONTEXT, **_EXPERT}),
    'fsdp_tensor': Rules(
        params={'embed': ('fsdp',), **{n: ('tensor',) for n in _TENSOR_NAMES}, **_STAGE,
                **_EXPERT},
        activations={**_batch('data', 'fsdp'), **{n: ('tensor',) for n in _TENSOR_NAMES},
                     **_CONTEXT, **_EXPERT}),
}


def rules_for(preset: str, mesh_shape: Mapping[str, int]) -> Rules:
  """The named preset ('auto' = the combined one) restricted to the mesh's non-trivial axes."""
  rules = RULE_PRESETS['fsdp_tensor' if preset == 'auto' else preset]
  return rules.restricted_to(mesh_shape)


def is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes_of(variable: nnx.Variable) -> tuple[str | None, ...]:
  """The logical name of each dimension of a parameter (None where it has none)."""
  ndim = len(variable.get_value().shape)
  axes = tuple(variable.get_metadata().get(LOGICAL_AXES) or ())
  return axes + (None,) * (ndim - len(axes))


def spec_axes(spec: P) -> MeshAxes:
  """The mesh axes a PartitionSpec splits over, in the order they appear."""
  axes = []
  for entry in spec:
    axes += [entry] if isinstance(entry, str) else list(entry or ())
  return tuple(axes)


def split_further(spec: P, shape: tuple[int, ...], axes: MeshAxes,
                  mesh_shape: Mapping[str, int]) -> P:
  """`spec` with the mesh `axes` it does not use added to its first dimension that divides by
  them (after the axes that dimension already has); `spec` itself where none divides. ZeRO-1
  lays an optimizer moment out so: its parameter's layout, split over the batch axes too."""
  used = set(spec_axes(spec))
  extra = tuple(a for a in axes if a not in used and mesh_shape[a] > 1)
  if not extra:
    return spec
  ways = int(np.prod([mesh_shape[a] for a in extra]))
  dims = list(spec) + [None] * (len(shape) - len(spec))
  for i, (size, entry) in enumerate(zip(shape, dims)):
    current = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    if size % (int(np.prod([mesh_shape[a] for a in current])) * ways) == 0:
      joined = current + extra
      dims[i] = joined[0] if len(joined) == 1 else joined
      return P(*dims)
  return spec


def variable_specs(abstract_state: nnx.State, rules: Rules) -> nnx.State:
  """PartitionSpecs for every Variable of an (abstract) model state, from its logical axes."""
  return jax.tree.map(lambda v: v.replace(rules.spec(logical_axes_of(v))), abstract_state,
                      is_leaf=is_variable)


def named(mesh: jax.sharding.Mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def abstract_model(create: Callable[[nnx.Rngs], nnx.Module]):
  """(graphdef, abstract state) of a model, without allocating it."""
  model = nnx.eval_shape(lambda: create(nnx.Rngs(0)))
  return nnx.split(model)


def sharded_init(init_fn: Callable[[], object], out_shardings):
  """Runs `init_fn` under jit so that every output is created already in its sharding.

  XLA partitions the initialisers themselves, so each device computes only its own shards: no
  device ever holds a whole unsharded parameter. Returns (state, compiled) so callers can read the
  compiled init's memory analysis.
  """
  jitted = jax.jit(init_fn, out_shardings=out_shardings)
  compiled = jitted.lower().compile()
  return compiled(), compiled


def bytes_per_device(tree) -> int:
  """Bytes that one device holds of a tree of (possibly sharded) jax.Arrays or abstract arrays."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) else x.shape
    total += int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
  return total
