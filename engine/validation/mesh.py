"""The mesh section: its sizes over the devices, and its split across hosts or TPU slices
(engine.validation calls `check_mesh`)."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine.config import MESH_AXES, resolve_mesh_shape
from engine.errors import ConfigError


def count_slices(devices) -> int:
  """How many TPU slices the devices form (1 off multi-slice TPU pods)."""
  return len({getattr(d, 'slice_index', 0) for d in devices})


def check_mesh(mesh_config: ConfigDict, num_devices: int, num_processes: int,
               num_slices: int, platform: str = '') -> dict[str, int]:
  """The mesh's sizes over the devices, and its split across hosts or slices. `platform`: the
  devices' ('cpu' adds the way to simulate more to the error of a mesh too large)."""
  try:
    mesh = resolve_mesh_shape(mesh_config, num_devices)
  except ConfigError as error:
    needed = math.prod(int(mesh_config.get(axis, 1)) for axis in MESH_AXES
                       if int(mesh_config.get(axis, 1)) > 0)
    if platform != 'cpu' or num_processes > 1 or needed <= num_devices:
      raise
    raise ConfigError(
        f'{str(error).rstrip(".")}; on CPU, simulate {needed} devices by starting the command '
        f'with XLA_FLAGS=--xla_force_host_platform_device_count={needed}.') from None
  for axis in ('data', 'fsdp'):
    dcn = mesh_config[f'dcn_{axis}']
    if dcn < 1 or mesh[axis] % dcn:
      raise ConfigError(f'mesh.dcn_{axis}={dcn} must be >= 1 and divide mesh.{axis}={mesh[axis]} '
                        f'(the {axis} axis is split into dcn_{axis} groups across hosts).')
  hosts = mesh_config.dcn_data * mesh_config.dcn_fsdp
  if num_slices > 1 and hosts != num_slices:
    raise ConfigError(
        f'mesh.dcn_data*mesh.dcn_fsdp={hosts} must equal the number of TPU slices '
        f'({num_slices}): the data-centre network joins the slices along those axes; set '
        f'mesh.dcn_data={num_slices} (or split it with mesh.dcn_fsdp).')
  if hosts > 1 and num_slices == 1 and hosts != num_processes:
    raise ConfigError(
        f'mesh.dcn_data*mesh.dcn_fsdp={hosts} must equal the number of processes '
        f'({num_processes}), one group of devices per host; set them to 1 to let the mesh follow '
        'the device order.')
  return mesh
