"""The named device mesh (data, fsdp, tensor) built from the mesh config."""

from __future__ import annotations

import jax
from jax.sharding import AxisType

from engine.config import MESH_AXES, resolve_mesh_shape


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """A mesh with axes ('data', 'fsdp', 'tensor') and Auto axis types (jit mode inserts the
  collectives; shard_map mode makes every axis manual inside its body)."""
  devices = jax.devices() if devices is None else devices
  sizes = resolve_mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[axis] for axis in MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def mesh_shape(mesh: jax.sharding.Mesh) -> dict[str, int]:
  return dict(mesh.shape)
