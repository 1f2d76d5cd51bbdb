"""Manual mode's Muon: each split matrix made whole for Newton-Schulz, and the result returned to
the blocks the devices hold.

A parameter is held in blocks split over the mesh axes of its PartitionSpec. Newton-Schulz needs
each matrix whole, so before optax's momentum and Newton-Schulz step (engine/muon.py) the update
and the momentum of each split matrix are made whole, the step runs, and the update and the new
momentum go back to the blocks. Two ways, per parameter (`matrix_plan`):

  exchange: a stack of matrices (stacked layers, experts) whose local stack divides over the n
    devices of the split: one all_to_all per split axis hands each device whole matrices for
    1 / n of the stack, and one more hands the results back. Each matrix is orthogonalized once;
    each step sends, per device, 4 x the float32 block (the update and momentum there and back),
    (n - 1) / n of it to other devices, and holds no whole stack.
  gather: any other (a stack that does not divide, a lone matrix): all-gathered whole on every
    device of the split and orthogonalized there, each device keeping its own block; 2 x the
    whole float32 matrix arrives per step, and the work is repeated on the n devices.

Batch dimensions split over the mesh (stacked layers over stage, experts over expert) stay split:
those are separate matrices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.muon import is_dims, matrix_axes
from engine.sharding import spec_axes


@dataclasses.dataclass(frozen=True)
class MatrixPlan:
  """How manual mode makes one parameter's matrices whole: `splits` (matrix dimension, the mesh
  axes splitting it), gathered one after another; or with `stack_dim`, the batch dimension whose
  blocks are exchanged for them instead (all_to_all)."""
  splits: tuple[tuple[int, tuple[str, ...]], ...]
  stack_dim: int | None


def matrix_plan(spec: P, dims, local_shape, mesh_shape: dict[str, int]) -> MatrixPlan:
  """The plan for a parameter laid out by `spec` with these Muon dimension numbers, whose block
  on a device has `local_shape`."""
  matrix = sorted(sum(matrix_axes(dims), ()))
  splits = []
  for dim in matrix:
    axes = spec_axes(P(spec[dim])) if dim < len(spec) else ()
    if math.prod(mesh_shape[a] for a in axes) > 1:
      splits.append((dim, axes))
  ways = math.prod(mesh_shape[a] for _, axes in splits for a in axes)
  stack = [d for d in range(len(local_shape)) if d not in matrix and local_shape[d] % ways == 0]
  return MatrixPlan(tuple(splits), stack[0] if splits and stack else None)


class MatrixBlocks:
  """Every Muon matrix's plan, and the collectives that carry it out on the trees Muon's part of
  the optimizer sees (the parameters' structure, the others masked)."""

  def __init__(self, setup):
    self.mesh_shape = dict(setup.mesh.shape)
    specs = _keyed(setup.param_specs, lambda x: isinstance(x, P))
    shapes = _keyed(setup.abstract_params, None)
    self.plans = {
        key: matrix_plan(specs[key], dims,
                         NamedSharding(setup.mesh, specs[key]).shard_shape(shapes[key].shape),
                         self.mesh_shape)
        for key, dims in _keyed(setup.optimizer.matrix_dims, is_dims).items()
        if dims is not None}

  def whole(self, tree):
    """Each leaf's matrices made whole: exchanged for whole ones of part of the stack, or
    gathered."""
    def whole_leaf(path, x):
      plan = self.plans[jax.tree_util.keystr(path)]
      for dim, axes in plan.splits:
        if plan.stack_dim is None:
          x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
        else:
          x = jax.lax.all_to_all(x, axes, plan.stack_dim, dim, tiled=True)
      return x
    return jax.tree_util.tree_map_with_path(whole_leaf, tree)

  def blocks(self, tree):
    """`whole`'s inverse: each leaf back to this device's block."""
    def block(path, x):
      plan = self.plans[jax.tree_util.keystr(path)]
      for dim, axes in reversed(plan.splits):
        if plan.stack_dim is not None:
          x = jax.lax.all_to_all(x, axes, dim, plan.stack_dim, tiled=True)
          continue
        index = 0
        for axis in axes:  # Row-major over the axes, as the spec lays the blocks out.
          index = index * self.mesh_shape[axis] + jax.lax.axis_index(axis)
        size = x.shape[dim] // math.prod(self.mesh_shape[a] for a in axes)
        x = jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)
      return x
    return jax.tree_util.tree_map_with_path(block, tree)

  def on_whole_matrices(self, orthogonalized: optax.GradientTransformation
                        ) -> optax.GradientTransformation:
    """`orthogonalized` (engine/muon.py: optax's scale_by_muon, then the width scale) run on
    whole matrices: its first state is scale_by_muon's, whose momentum travels with the
    update."""

    def update(updates, state, params=None):
      del params  # Muon's orthogonalizing part reads none.
      momentum, *rest = state
      whole_state = (momentum._replace(mu=self.whole(momentum.mu)), *rest)
      updates, (momentum, *rest) = orthogonalized.update(self.whole(updates), whole_state)
      return self.blocks(updates), (momentum._replace(mu=self.blocks(momentum.mu)), *rest)

    return optax.GradientTransformation(orthogonalized.init, update)


def _keyed(tree, is_leaf) -> dict:
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf)[0]}
