"""One run per workdir: WORKDIR/run.lock, held by process 0 of the training run for its lifetime.

Two runs writing one workdir corrupt it (interleaved checkpoints, a config.json that matches
neither), so a second run is refused, in one line naming the holder, before it writes anything.
Only training takes the lock: generate / evaluate / export read a finished (or running) run's
checkpoints and are not blocked.

The lock file holds JSON: host, boot id, OS pid and its start time, jax process count, start
time, a heartbeat (rewritten every HEARTBEAT_S by a thread) and a random run id. A lock whose
holder is gone is taken over, with a warning naming it:
  * same host and boot: the pid is not running, or is now another process (its start time in
    /proc/PID/stat differs): a SIGKILLed or crashed run;
  * another host, or the same host name after a reboot: the heartbeat is older than STALE_S.
A local lock is created atomically (a complete file hard-linked into place, so it is never seen
half written; O_CREAT|O_EXCL where links are not supported). Remote workdirs (gs://) have no
atomic create through etils.epath: there the lock is written if absent and read back, which
refuses a second run that starts seconds later but not one that starts in the same instant.

Several processes: process 0 decides and broadcasts the outcome, so every process of a refused
run stops with the same line (none waits on the others).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
import uuid

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from engine.errors import ConfigError
from engine.workdir.run_dir import is_remote

LOCK_FILE = 'run.lock'
HEARTBEAT_S = 30.0  # How often the holder rewrites its heartbeat.
STALE_S = 120.0  # A lock from elsewhere whose heartbeat is this old is taken over.


def _boot_id() -> str | None:
  with contextlib.suppress(OSError):
    return epath.Path('/proc/sys/kernel/random/boot_id').read_text().strip()
  return None


def process_start(pid: int) -> int | None:
  """The process's start time (clock ticks since boot, /proc/PID/stat field 22): a pid reused
  by another process has another. None where /proc is missing or the pid is not running."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except OSError:
    return None
  return int(stat.rsplit(')', 1)[1].split()[19])  # The name in (...) may hold spaces.


def record(run_id: str, pid: int | None = None) -> dict:
  """The lock's content for the process `pid` (default: this one) of this run."""
  pid = os.getpid() if pid is None else pid
  return {'host': socket.gethostname(), 'boot_id': _boot_id(), 'pid': pid,
          'pid_start': process_start(pid), 'processes': jax.process_count(),
          'started': datetime.datetime.now().isoformat(timespec='seconds'),
          'heartbeat': time.time(), 'run_id': run_id}


def _read(path: epath.Path) -> dict | None:
  """The lock's record; None if there is no lock; {'unreadable': age} for a damaged one."""
  try:
    text = path.read_text()
  except FileNotFoundError:
    return None
  try:
    record = json.loads(text)
    if isinstance(record, dict) and 'pid' in record:
      return record
  except ValueError:
    pass
  with contextlib.suppress(OSError):
    return {'unreadable': time.time() - path.stat().mtime}
  return None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Another user's process.
    return True
  return True


def stale_reason(holder: dict) -> str | None:
  """Why the lock's holder is gone (None: it may still run)."""
  if 'unreadable' in holder:
    age = holder['unreadable']
    return f'the lock is unreadable and {age:.0f} s old' if age > STALE_S else None
  here = holder.get('host') == socket.gethostname() and holder.get('boot_id') == _boot_id()
  if here:
    pid = int(holder['pid'])
    if not _alive(pid):
      return f'pid {pid} is not running'
    start = process_start(pid)
    if None not in (start, holder.get('pid_start')) and start != holder['pid_start']:
      return f'pid {pid} is now another process'
    return None
  age = time.time() - float(holder.get('heartbeat', 0))
  return f'its heartbeat is {age:.0f} s old' if age > STALE_S else None


def describe(holder: dict) -> str:
  """The holder as the refusal and the take-over warning name it."""
  if 'unreadable' in holder:
    return 'a run whose lock file is unreadable'
  processes = int(holder.get('processes', 1))
  of = f' (process 0 of {processes} jax processes)' if processes > 1 else ''
  return (f'host {holder.get("host")}, pid {holder.get("pid")}{of}, started '
          f'{holder.get("started")}')


def _create(path: epath.Path, record: dict) -> bool:
  """Writes the lock if there is none; whether this call wrote it."""
  text = json.dumps(record)
  if is_remote(path):  # No atomic create: write if absent, then see whose it is.
    if path.exists():
      return False
    path.write_text(text)
    time.sleep(0.5)
    return (_read(path) or {}).get('run_id') == record['run_id']
  tmp = f'{path}.{record["run_id"]}'
  with open(tmp, 'w') as f:
    f.write(text)
  try:
    os.link(tmp, path)
    return True
  except FileExistsError:
    return False
  except OSError:  # No hard links here (some FUSE file systems): an exclusive create.
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'w') as f:
      f.write(text)
    return True
  finally:
    os.unlink(tmp)


def _remove_stale(path: epath.Path, holder: dict) -> bool:
  """Removes the stale lock `holder`; False if another run replaced it meanwhile."""
  if is_remote(path):
    path.unlink(missing_ok=True)
    return True
  aside = f'{path}.stale.{uuid.uuid4().hex}'
  try:
    os.rename(path, aside)
  except FileNotFoundError:
    return True  # Someone else removed it: try to create ours.
  moved = _read(epath.Path(aside))
  if moved is not None and moved.get('run_id') != holder.get('run_id'):
    # Another newcomer took the stale lock over first: give its lock back.
    with contextlib.suppress(FileExistsError):
      os.link(aside, path)
    os.unlink(aside)
    return False
  os.unlink(aside)
  return True


def take(path: epath.Path, record: dict) -> dict | None:
  """Takes the lock at `path` for `record`; None when taken, else the live holder's record."""
  for _ in range(5):
    if _create(path, record):
      return None
    holder = _read(path)
    if holder is None:
      continue  # Released in between: try again.
    reason = stale_reason(holder)
    if reason is None:
      return holder
    if _remove_stale(path, holder):
      logging.warning('Taking over %s from a run that is gone (%s): %s.', path,
                      describe(holder), reason)
  return _read(path) or {'unreadable': 0.0}


def _rewrite(path: epath.Path, record: dict) -> None:
  if is_remote(path):
    path.write_text(json.dumps(record))
    return
  tmp = f'{path}.{record["run_id"]}'
  with open(tmp, 'w') as f:
    f.write(json.dumps(record))
  os.replace(tmp, path)  # Readers see the old record or the new one, never half of one.


class RunLock:
  """The lock this process holds: its heartbeat refreshed by a thread until `release`."""

  def __init__(self, path: epath.Path, record: dict):
    self.path, self.record = path, record
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name='run-lock-heartbeat', daemon=True)
    self._thread.start()

  def _ours(self) -> bool:
    return (_read(self.path) or {}).get('run_id') == self.record['run_id']

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        if not self._ours():
          logging.error('%s is no longer this run\'s: another run took it over (this run\'s '
                        'heartbeat was late); stop one of them.', self.path)
          return
        self.record['heartbeat'] = time.time()
        _rewrite(self.path, self.record)
      except OSError as error:  # A transient storage error: the next beat tries again.
        logging.warning('Could not refresh %s (%s).', self.path, error)

  def release(self) -> None:
    self._stop.set()
    self._thread.join()
    with contextlib.suppress(OSError):
      if self._ours():
        self.path.unlink()


def refusal(workdir: epath.Path, holder: dict) -> str:
  return (f'--workdir={workdir} is in use by another run ({describe(holder)}; lock '
          f'{workdir / LOCK_FILE}); wait for that run to finish or stop it, or pass another '
          '--workdir.')


def _decide(workdir: epath.Path) -> tuple[RunLock | None, str]:
  """Process 0's side: the lock taken, or the line that refuses this run."""
  path, mine = workdir / LOCK_FILE, record(uuid.uuid4().hex)
  try:
    holder = take(path, mine)
  except OSError as error:
    return None, (f'--workdir={workdir}: its lock {path} cannot be taken '
                  f'({error.strerror or error}); fix the directory\'s permissions, or pass '
                  'another --workdir.')
  return (RunLock(path, mine), '') if holder is None else (None, refusal(workdir, holder))


@contextlib.contextmanager
def hold(workdir: epath.Path):
  """Holds the workdir's lock for the run inside the `with` (on every process of the run);
  raises ConfigError, naming the holder, where another run holds it."""
  lock, message = _decide(workdir) if jax.process_index() == 0 else (None, '')
  try:
    refused = bool(message)
    if jax.process_count() > 1:  # Every process stops, or none does.
      refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refused)))
    if refused:
      holder = None if message else _read(workdir / LOCK_FILE)  # Process 0 wrote the line.
      raise ConfigError(message or (refusal(workdir, holder) if holder else (
          f'--workdir={workdir} is in use by another run (process 0 names it); wait for that '
          'run to finish or stop it, or pass another --workdir.')))
    yield
  finally:
    if lock is not None:
      lock.release()
