"""The named device mesh (data, fsdp, tensor, context, stage, expert) built from the mesh config."""

from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType

from engine.config import MESH_AXES, resolve_mesh_shape


def make_mesh(mesh_config, devices=None) -> jax.sharding.Mesh:
  """A mesh with axes ('data', 'fsdp', 'tensor', 'context', 'stage', 'expert') and Auto axis
  types (jit mode inserts the collectives; shard_map mode makes every axis manual inside its
  body). `expert` is last: jax.make_mesh makes the last axis the device-contiguous one (the
  closest neighbours), which suits the experts' all-to-all.

  With mesh.dcn_data / mesh.dcn_fsdp > 1 the mesh is hybrid: those axes are split into groups
  across hosts (TPU slices where there are several, else processes) and every other axis stays
  within a host, so tensor-parallel traffic never crosses the slow network.
  """
  devices = jax.devices() if devices is None else devices
  sizes = resolve_mesh_shape(mesh_config, len(devices))
  shape = tuple(sizes[axis] for axis in MESH_AXES)
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  dcn = (mesh_config.get('dcn_data', 1), mesh_config.get('dcn_fsdp', 1)) + (1,) * (
      len(MESH_AXES) - 2)
  if math.prod(dcn) == 1:
    try:
      return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
      # A TPU torus whose axes no product of physical axes matches (32 x 16 x 8 on 16x16x16):
      # split physical axes rather than refuse the shape.
      device_array = mesh_utils.create_device_mesh(shape, devices,
                                                   allow_split_physical_axes=True)
      return jax.sharding.Mesh(device_array, MESH_AXES, axis_types=axis_types)
  per_host = tuple(size // d for size, d in zip(shape, dcn))
  several_slices = len({getattr(d, 'slice_index', 0) for d in devices}) > 1
  device_array = mesh_utils.create_hybrid_device_mesh(
      per_host, dcn, devices, process_is_granule=not several_slices,
      allow_split_physical_axes=True)
  return jax.sharding.Mesh(device_array, MESH_AXES, axis_types=axis_types)

