"""Manual mode's Muon: each split matrix made whole for Newton-Schulz, then cut back to this
device's block.

A parameter is held in blocks split over the mesh axes of its PartitionSpec. Before optax's
momentum and Newton-Schulz step (engine/muon.py), the update and the momentum of each matrix are
all-gathered, in float32, along the matrix dimensions that are split (fsdp's embed, tensor's
heads / kv_heads / mlp); the step runs on the whole matrix, and the update and the new momentum
are cut back to this device's block. Batch dimensions stay split: stacked layers over stage and
experts over expert are separate matrices. Every device of a split thus orthogonalizes the same
matrix (the work is repeated, not divided), and each step gathers 2 x 4 bytes per element of a
split matrix, (n - 1) / n of them from the n - 1 other devices of its split.
"""

from __future__ import annotations

import math

import jax
import optax
from jax.sharding import PartitionSpec as P

from engine.muon import is_dims
from engine.sharding import spec_axes


class MatrixBlocks:
  """Where each Muon matrix is split: the all-gathers that make it whole and the slice that cuts
  this device's block back, for the trees Muon's part of the optimizer sees (the parameters'
  structure, the others masked)."""

  def __init__(self, param_specs, matrix_dims, mesh_shape: dict[str, int]):
    keyed = lambda tree, is_leaf: {jax.tree_util.keystr(path): leaf for path, leaf in
                                   jax.tree_util.tree_flatten_with_path(tree, is_leaf)[0]}
    specs = keyed(param_specs, lambda x: isinstance(x, P))
    self.splits = {key: split_dims(specs[key], dims, mesh_shape)
                   for key, dims in keyed(matrix_dims, is_dims).items() if dims is not None}
    self.mesh_shape = mesh_shape

  def gathered(self, tree):
    """Each leaf made whole along its split matrix dimensions."""
    def gather(path, x):
      for dim, axes in self.splits[jax.tree_util.keystr(path)]:
        x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
      return x
    return jax.tree_util.tree_map_with_path(gather, tree)

  def cut(self, tree):
    """Each whole leaf cut back to this device's block."""
    def block(path, x):
      for dim, axes in self.splits[jax.tree_util.keystr(path)]:
        index = 0
        for axis in axes:  # Row-major over the axes, as the spec lays the blocks out.
          index = index * self.mesh_shape[axis] + jax.lax.axis_index(axis)
        size = x.shape[dim] // math.prod(self.mesh_shape[a] for a in axes)
        x = jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=dim)
      return x
    return jax.tree_util.tree_map_with_path(block, tree)

  def whole(self, orthogonalized: optax.GradientTransformation) -> optax.GradientTransformation:
    """`orthogonalized` (engine/muon.py: optax's scale_by_muon, then the width scale) run on
    whole matrices: its first state is scale_by_muon's, whose momentum is gathered and cut
    like the update."""

    def update(updates, state, params=None):
      del params  # Muon's orthogonalizing part reads none.
      momentum, *rest = state
      whole_state = (momentum._replace(mu=self.gathered(momentum.mu)), *rest)
      updates, (momentum, *rest) = orthogonalized.update(self.gathered(updates), whole_state)
      return self.cut(updates), (momentum._replace(mu=self.cut(momentum.mu)), *rest)

    return optax.GradientTransformation(orthogonalized.init, update)


def split_dims(spec: P, dims, mesh_shape) -> list[tuple[int, tuple[str, ...]]]:
  """(dimension, the mesh axes splitting it) for each split matrix dimension of a parameter
  laid out by `spec`, in the order MatrixBlocks gathers them."""
  matrix = [*_axes(dims.reduction_axis), *_axes(dims.output_axis)]
  splits = []
  for dim in sorted(matrix):
    axes = spec_axes(P(spec[dim])) if dim < len(spec) else ()
    if math.prod(mesh_shape[a] for a in axes) > 1:
      splits.append((dim, axes))
  return splits


def _axes(axis) -> tuple[int, ...]:
  return (axis,) if isinstance(axis, int) else tuple(axis)
