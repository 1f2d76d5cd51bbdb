"""What a launcher can read of the command it runs: the experiment's mesh, from
`--config=FILE[:ARG]` and `--config.mesh.*=` overrides, so that a job whose processes and devices
cannot make that mesh is refused before it is queued, not after."""

from __future__ import annotations

import importlib.util
import math
import os

from engine import config as config_lib
from engine.cli.argv import fail, flag_value
from engine.errors import ConfigError


def command_mesh(command: list[str]) -> tuple[dict, str] | None:
  """(the mesh section as a dict, the --config given) of an engine command, or None when the
  command names no experiment file (it is not the engine's, or takes no --config)."""
  given = flag_value(command, 'config')
  if not given or not any(arg.startswith('engine.') for arg in command):
    return None  # Not `python -m engine.X --config=...`: another program's --config.
  path, _, arg = given.partition(':')
  if not os.path.isfile(path):
    fail(f'--config={given} (in the command) is not a file here; run the launcher from the '
         'directory the job runs in (the project root), or fix the path.')
  spec = importlib.util.spec_from_file_location('_launched_experiment', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as error:  # pylint: disable=broad-except
    fail(f'--config={given} (in the command) failed to load ({type(error).__name__}: {error}); '
         'run the command by itself to see why.')
  mesh = {key: int(value) for key, value in config.mesh.items()}
  for key in mesh:
    override = flag_value(command, f'config.mesh.{key}')
    if override is not None and override.lstrip('-').isdigit():
      mesh[key] = int(override)
  return mesh, given


def check_job_fits_mesh(command: list[str], processes: int, devices_per_process: int,
                        how: str) -> None:
  """The job's devices (processes x devices each) must make the command's mesh, and a mesh laid
  across hosts (mesh.dcn_data x mesh.dcn_fsdp > 1) must have one group per process; `how` names
  the launcher's flags that set the counts."""
  found = command_mesh(command)
  if found is None:
    return
  mesh, given = found
  devices = processes * devices_per_process
  sizes = [mesh.get(axis, 1) for axis in config_lib.MESH_AXES]
  fixed = math.prod(s for s in sizes if s != -1)
  try:  # The sizes themselves, as the engine checks them (any valid mesh fills `fixed`).
    config_lib.resolve_mesh_shape(mesh, fixed)
  except ConfigError as error:
    fail(f'--config={given} (in the command): {error}')
  if not _fills(mesh, devices):
    shape = config_lib.format_mesh(mesh, all_axes=True)
    needs = f'a multiple of {fixed}' if -1 in sizes else str(fixed)
    fail(f'the job has {processes} processes x {devices_per_process} devices = {devices} '
         f'devices ({how}), but the mesh of --config={given} is {shape}, which needs {needs}; '
         f'change the flags to give {needs} devices, or the mesh (e.g. one axis -1).')
  hosts = mesh['dcn_data'] * mesh['dcn_fsdp']
  if hosts > 1 and hosts != processes:
    fail(f'the job has {processes} processes ({how}), but mesh.dcn_data*mesh.dcn_fsdp={hosts} '
         f'in --config={given} asks for {hosts}, one per host; run one process per host '
         f'(--tasks=per_host), or set mesh.dcn_data*mesh.dcn_fsdp to {processes} or 1.')


def _fills(mesh: dict, devices: int) -> bool:
  """Whether the mesh's sizes (one -1 filled in) make `devices` devices."""
  try:
    config_lib.resolve_mesh_shape(mesh, devices)
  except ConfigError:
    return False
  return True
