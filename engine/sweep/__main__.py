"""Sweeps: every combination of a grid of config values trained, each in its own workdir.

  python -m engine.sweep --config=experiments/tiny.py --config.train.num_steps=100 \
      --grid=optim.learning_rate=1e-3,3e-3 --grid=model.num_layers=2,4 --workdir=/tmp/sweep

Each variant runs as `python -m engine.main --config=EXP [the sweep's --config.* flags] [the
variant's values] --workdir=DIR/<variant>`, one after another (--print_commands prints those
command lines, for a launcher, and runs nothing). `mode` is short for parallelism.mode and `mesh`
for the mesh (e.g. --grid=mesh=8x1x1,2x2x2). Every variant's config is checked before the first
starts, in a short child process (so that this one never holds the accelerators): a bad one is
one `error:` line. DIR/sweep.json records each variant's status; a rerun skips the finished
ones and resumes the others from their checkpoints. A failed variant is recorded (exit status,
last error line; its output is in DIR/logs/<variant>.log) and the sweep goes on; the exit status
is 1 if any failed. SIGTERM or SIGINT stops the running variant after a checkpoint (recorded
as preempted) and the sweep. At the end: DIR/sweep.md and DIR/sweep.csv (final and best eval loss,
median tokens/s, peak memory, status), printed too, and DIR/loss_curves.png.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import jax
from absl import flags
from ml_collections import config_flags

from engine import assemble
from engine.sweep import grid as sweep_grid
from engine.sweep import report as sweep_report
from engine.cli.command_line import _given, fail, run_command
from engine.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file, optionally '
                                          'with :arg.', lock_config=False)
_GRID = flags.DEFINE_multi_string('grid', [], 'KEY=V1,V2,...: a config key (or mode, mesh) and '
                                  'its values; repeat for more keys (every combination runs).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory of the sweep: one workdir per variant, '
                               'sweep.json, the table and the plot; rerun with it to resume.')
_PRINT = flags.DEFINE_bool('print_commands', False, "Print each variant's engine.main command "
                           'line (for a launcher) and exit; the configs are checked, but not '
                           'against this machine\'s devices.')
_CHECK_ONLY = flags.DEFINE_bool('check_only', False, "Check every variant's config against this "
                                "machine's devices, then exit.")
_OVERRIDE = re.compile(r'^--?(?:no)?config\.')
STATE_FILE = 'sweep.json'


def _configs(variants) -> list:
  """Every variant's config (a value of the wrong type is refused here)."""
  return [sweep_grid.variant_config(_CONFIG.value, variant) for variant in variants]


def _check_on_devices(variants, configs) -> None:
  """What engine.main checks before it compiles, for every variant, on this machine's devices
  (only this child process starts JAX's backend: the variants' processes need the devices)."""
  for variant, config in zip(variants, configs):
    try:
      assemble.check(config, jax.devices())
    except ConfigError as error:
      raise ConfigError(f'variant {variant.name}: {error}') from None


def _check_workdir(workdir: str) -> None:
  if not workdir.strip():
    raise ConfigError('--workdir is empty; pass the directory of the sweep, e.g. '
                      '--workdir=/tmp/sweep.')
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f'--workdir={workdir} is a file, not a directory; pass a new path or the '
                      'directory of the sweep to resume.')


class Stopped(Exception):
  """SIGTERM or SIGINT reached the sweep (its args: the variant then running, if known)."""


def _stop(signum, frame) -> None:
  del signum, frame
  raise Stopped()


def _load_state(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return {}
  except (OSError, json.JSONDecodeError) as error:
    raise ConfigError(f'{path} cannot be read ({error}); remove it to start the sweep\'s '
                      'records afresh (finished variants then rerun, resuming from their '
                      'checkpoints).') from None


def _save_state(path: str, state: dict) -> None:
  with open(path + '.tmp', 'w') as f:
    json.dump(state, f, indent=2)
  os.replace(path + '.tmp', path)  # A crash leaves the old record, never half of one.


def _last_error(log_path: str) -> str:
  """The child's last `error:` line, else its last line."""
  with open(log_path, errors='replace') as f:
    lines = [line.strip() for line in f if line.strip()]
  errors = [line for line in lines if line.startswith('error:')]
  return (errors or lines or [''])[-1]


def _final_step(workdir: str) -> int:
  steps = [r['step'] for r in sweep_report.read_metrics(workdir) if 'step' in r]
  return max(steps, default=0)


def run_variant(command: list[str], workdir: str, log_path: str, num_steps: int) -> dict:
  """Runs one variant's engine.main to its end; its record for sweep.json."""
  start = time.monotonic()
  with open(log_path, 'a') as log:
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
      code = child.wait()
    except BaseException:  # The sweep was stopped: so is the variant, after a checkpoint.
      child.send_signal(signal.SIGTERM)  # Its first SIGTERM: a clean stop (engine.train.preemption).
      child.wait()
      raise
  record = {'exit_code': code, 'seconds': round(time.monotonic() - start, 1),
            'command': shlex.join(command), 'log': log_path}
  if code != 0:
    return {'status': 'failed', 'error': _last_error(log_path), **record}
  if _final_step(workdir) < num_steps:  # Stopped by a signal, with a checkpoint.
    return {'status': 'preempted', **record}
  return {'status': 'finished', **record}


def _run_all(directory: str, variants, configs, commands) -> dict:
  """Runs the variants not finished yet, recording each in sweep.json as it ends."""
  state_path = os.path.join(directory, STATE_FILE)
  state = _load_state(state_path)
  os.makedirs(os.path.join(directory, 'logs'), exist_ok=True)
  for i, (variant, config, command) in enumerate(zip(variants, configs, commands), 1):
    where = f'[{i}/{len(variants)}] {variant.name}'
    before = state.get(variant.name, {})
    if sweep_grid.already_finished(before, command):
      print(f'{where}: finished before, skipped', flush=True)
      continue
    if before.get('status') == 'finished':
      print(f'{where}: finished before with another command; running it again', flush=True)
    print(f'{where}: started', flush=True)
    log_path = os.path.join(directory, 'logs', f'{variant.name}.log')
    try:
      record = run_variant(command, os.path.join(directory, variant.name), log_path,
                           config.train.num_steps)
    except (KeyboardInterrupt, Stopped):
      state[variant.name] = {'status': 'preempted', 'command': shlex.join(command),
                             'log': log_path}
      _save_state(state_path, state)
      raise Stopped(variant.name) from None
    state[variant.name] = record
    _save_state(state_path, state)
    error = f': {record["error"]}' if 'error' in record else ''
    print(f'{where}: {record["status"]} in {record["seconds"]:.1f} s{error}', flush=True)
  return state


def _base_overrides(args: list[str]) -> list[str]:
  """The sweep's own --config.KEY=VALUE flags, for every variant (a value given as the next
  argument, --config.KEY VALUE, joined to its flag)."""
  found = []
  for i, arg in enumerate(args):
    if not _OVERRIDE.match(arg):
      continue
    following = args[i + 1] if i + 1 < len(args) else '-'
    found.append(arg if '=' in arg or following.startswith('-') else f'{arg}={following}')
  return found


def main(argv):
  del argv
  variants = sweep_grid.variants(sweep_grid.parse_grid(_GRID.value))
  configs = _configs(variants)
  if _CHECK_ONLY.value:
    return _check_on_devices(variants, configs)
  directory = _WORKDIR.value
  _check_workdir(directory)
  experiment = _given(sys.argv, 'config')
  base = _base_overrides(sys.argv[1:])
  commands = [sweep_grid.command(experiment, base, v, os.path.join(directory, v.name))
              for v in variants]
  if _PRINT.value:
    print('\n'.join(shlex.join(c) for c in commands))
    return
  check = subprocess.run([sys.executable, '-m', 'engine.sweep', *sys.argv[1:], '--check_only'],
                         check=False)
  if check.returncode:
    sys.exit(check.returncode)  # The child said why, in one line.
  os.makedirs(directory, exist_ok=True)
  signal.signal(signal.SIGTERM, _stop)
  try:
    state = _run_all(directory, variants, configs, commands)
  except Stopped as stopped:
    running = stopped.args[0] if stopped.args else 'a variant'
    fail(f'stopped by a signal while {running} ran (recorded as preempted in '
         f'{os.path.join(directory, STATE_FILE)}); rerun the same command to resume it from its '
         'checkpoint.', 1)
  workdirs = {v.name: os.path.join(directory, v.name) for v in variants}
  rows = {name: sweep_report.results(workdirs[name], state.get(name, {}).get('status', '-'))
          for name in workdirs}
  print(sweep_report.write_all(directory, rows, workdirs), end='')
  failed = [name for name, row in rows.items() if row['status'] != 'finished']
  if failed:
    fail(f'{len(failed)} of {len(rows)} variants did not finish ({", ".join(failed)}); their '
         f'errors are in {os.path.join(directory, STATE_FILE)} and logs/; rerun the same '
         'command to retry them.', 1)


if __name__ == '__main__':
  run_command(main, 'engine.sweep', required=('config', 'workdir'))
