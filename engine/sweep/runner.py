"""The sweep's runner: every variant's engine.main, one after another, its step and time left
logged while it runs (wait_reporting), each recorded as it ends.

DIR/sweep.json (STATE_FILE) records each variant's status, exit status, seconds, command line and
log; a rerun skips the variants finished with the same command line and resumes the others from
their checkpoints. A failed variant is recorded (its last `error:` line; its output is in
DIR/logs/<variant>.log) and the sweep goes on. SIGTERM or SIGINT stops the running variant after
a checkpoint (recorded as preempted) and raises Stopped. `check_on_devices` is what engine.main
checks before it compiles, for every variant (the command runs it in a child process).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time

import jax

from engine import assemble
from engine.sweep import grid as sweep_grid
from engine.sweep import report as sweep_report
from engine.errors import ConfigError
from engine.runtime.progress import Progress

STATE_FILE = 'sweep.json'


def check_on_devices(variants, configs) -> None:
  """What engine.main checks before it compiles, for every variant, on this machine's devices
  (only this child process starts JAX's backend: the variants' processes need the devices)."""
  for variant, config in zip(variants, configs):
    try:
      assemble.check(config, jax.devices())
    except ConfigError as error:
      raise ConfigError(f'variant {variant.name}: {error}') from None


def check_workdir(workdir: str) -> None:
  if not workdir.strip():
    raise ConfigError('--workdir is empty; pass the directory of the sweep, e.g. '
                      '--workdir=/tmp/sweep.')
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ConfigError(f'--workdir={workdir} is a file, not a directory; pass a new path or the '
                      'directory of the sweep to resume.')


class Stopped(Exception):
  """SIGTERM or SIGINT reached the sweep (its args: the variant then running, if known)."""


def stop(signum, frame) -> None:
  """The sweep's SIGTERM handler: run_all records the running variant as preempted."""
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


# How often the running variant's step and time left are logged, at most; how often its
# metrics.jsonl is read (often enough that the first line logged has a rate for the time left).
REPORT_EVERY_S, POLL_S = 15.0, 3.0


def _last_step(workdir: str) -> int | None:
  """The step of the last complete line of the variant's metrics.jsonl (None before it has
  one): only the file's end is read, however long the run."""
  try:
    with open(os.path.join(workdir, 'metrics.jsonl'), 'rb') as f:
      f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
      lines = f.read().decode(errors='replace').split('\n')[:-1]  # The last may be half written.
  except OSError:
    return None
  for line in reversed(lines):
    try:
      return int(json.loads(line)['step'])
    except (ValueError, KeyError, TypeError):
      continue  # The first line of the tail, cut at its start.
  return None


def wait_reporting(child: subprocess.Popen, workdir: str, num_steps: int, label: str,
                   every_s: float = REPORT_EVERY_S, poll_s: float = POLL_S) -> int:
  """Waits for the variant's process to end (its exit status), logging its step and time left
  at most every `every_s` seconds from its metrics.jsonl, which engine.main writes line by line:
  the run's own record, so the sweep needs no pipe or thread, and the child's whole output stays
  in its log file. A resumed variant's file ends with the earlier attempt's last step until the
  child rewrites it: that step is not this attempt's progress."""
  progress = Progress(num_steps, label, 'step', every_s)
  before = _last_step(workdir)
  while True:
    try:
      return child.wait(timeout=poll_s)
    except subprocess.TimeoutExpired:
      step = _last_step(workdir)
      if step is not None and step != before and step > progress.done:
        progress.update(step)


def run_variant(command: list[str], workdir: str, log_path: str, num_steps: int,
                label: str = 'the variant') -> dict:
  """Runs one variant's engine.main to its end, logging its progress (`label` names it); its
  record for sweep.json."""
  start = time.monotonic()
  with open(log_path, 'a') as log:
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
      code = wait_reporting(child, workdir, num_steps, label)
    except BaseException:  # The sweep was stopped: so is the variant, after a checkpoint.
      # Its first SIGTERM: a clean stop (engine.train.preemption).
      child.send_signal(signal.SIGTERM)
      child.wait()
      raise
  record = {'exit_code': code, 'seconds': round(time.monotonic() - start, 1),
            'command': shlex.join(command), 'log': log_path}
  if code != 0:
    return {'status': 'failed', 'error': _last_error(log_path), **record}
  if _final_step(workdir) < num_steps:  # Stopped by a signal, with a checkpoint.
    return {'status': 'preempted', **record}
  return {'status': 'finished', **record}


def run_all(directory: str, variants, configs, commands) -> dict:
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
                           config.train.num_steps, where)
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
