"""The hang and straggler watchdog: a step that never finishes ends the run naming who did not
reach it; a process slower than the others is named in a warning.

Every process's main thread beats at the end of each phase of its steps (the loop's clock,
engine/train/clock.py: the batch read, the step dispatched, each hook's work at a sync point). A
thread of its own checks the beats once a second:

- **Hangs** (`train.hang_timeout_s`, 0: off). No beat for that long means this process waits
  for something that does not come: usually a collective that another process never joins (it
  stopped, its host failed) or a dead data source. The watchdog writes this process's Python
  stacks (every thread) to WORKDIR/stacks/process_N.txt, names the processes to blame, and ends
  the run with one `error:` line; in a run of several processes every other process then writes
  its own stacks and stops too (engine/distributed/startup.py). To name them, each process's
  watchdog thread reports, every REPORT_EVERY_S through jax.distributed's key-value store (kept
  by the coordinator), the step its main thread is at and the time: a process whose reports
  stopped (STALE_S) has stopped responding (SIGSTOP, a frozen host), one at an earlier step did
  not reach the step. Nothing is timed before the second step: compiling and the first step
  may take long on their own.
- **Stragglers** (`train.straggler_factor`, 0: off). Each process measures its host time per
  step over each log interval: the time it spends on its own work (reading data, the hooks,
  logging), not waiting for the devices or the other processes (the step's dispatch and the
  explicit waits for it). In a synchronous run every process's step takes as long as the slowest
  one's, so this is where a slow host shows. Process 0 warns when a process's host time exceeds
  the factor times the median of the others' (and the others' by MIN_STRAGGLE_S), naming it and
  its times.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import jax
from absl import logging
from etils import epath

from engine.distributed import startup as distributed
from engine.train.clock import LoopClock
from engine.train.hooks import Hook

STACKS = 'stacks'  # WORKDIR/stacks/process_N.txt
_PROGRESS_KEY = 'engine/progress/'  # + process index: {"step": ..., "host_s": ...}
REPORT_EVERY_S = 1.0  # How often a process's watchdog thread reports its step.
STALE_S = 3.0  # A process whose last report is older has stopped responding.
MIN_STRAGGLE_S = 0.01  # Host time per step a straggler is behind by at least (noise below).


def dump_stacks(workdir: epath.Path) -> epath.Path:
  """Writes every thread's Python stack of this process to WORKDIR/stacks/process_N.txt."""
  path = workdir / STACKS / f'process_{jax.process_index()}.txt'
  with tempfile.TemporaryFile('w+') as f:  # faulthandler writes to a real file descriptor.
    faulthandler.dump_traceback(file=f, all_threads=True)
    f.seek(0)
    text = f.read()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return path


def stragglers(host_s: dict[int, float], factor: float) -> list[int]:
  """The processes whose host time per step exceeds `factor` times the median of the others'."""
  slow = []
  for index, seconds in host_s.items():
    others = [s for i, s in host_s.items() if i != index]
    if others:
      median = statistics.median(others)
      if seconds > factor * median and seconds - median > MIN_STRAGGLE_S:
        slow.append(index)
  return slow


class Watchdog(Hook):
  """The loop's last hook, which follows the steps and the host's time per step, and the thread
  that watches the clock's beats (module docstring)."""

  def __init__(self, workdir: epath.Path, hang_timeout_s: float, straggler_factor: float,
               log_every: int, start_step: int, clock: LoopClock):
    self.workdir, self.hang_timeout_s = workdir, hang_timeout_s
    self.straggler_factor, self.log_every = straggler_factor, log_every
    self.clock = clock
    self._first_step, self._step, self._timing = start_step, start_step, False
    # The interval's start: (the clock's time, its seconds in `device`), and its step.
    self._interval_start, self._interval_step = None, start_step
    self._host_s = None
    self._warned: set[tuple[int, int]] = set()
    self._stop = threading.Event()
    self._thread = None
    self._several = distributed.is_active()
    if self._several:
      distributed.add_exit_hook(lambda: dump_stacks(self.workdir))
    if hang_timeout_s or self._several:
      self._thread = threading.Thread(target=self._watch, name='engine_watchdog', daemon=True)
      self._thread.start()

  def before_dispatch(self, step: int, state) -> None:
    del state
    if self._interval_start is None:
      self._interval_start = (self.clock.now(), self.clock.seconds['device'])
    self._step = step
    if step > self._first_step + 1:
      self._timing = True  # The first step (warming up) is never timed.

  def after_dispatch(self, step: int, state, metrics) -> None:
    del state, metrics
    if step % self.log_every == 0 and step > self._interval_step:
      now, device = self.clock.now(), self.clock.seconds['device']
      start, device_before = self._interval_start
      steps = step - self._interval_step
      self._host_s = max(0.0, now - start - (device - device_before)) / steps
      self._interval_start, self._interval_step = (now, device), step
      self._check_stragglers(step)

  def close(self, error: BaseException | None) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)

  def _report(self) -> None:
    value = json.dumps({'step': self._step, 'time': time.time(), 'host_s': self._host_s})
    with contextlib.suppress(Exception):  # Reporting never stops a run.
      distributed.client().key_value_set(f'{_PROGRESS_KEY}{jax.process_index()}', value,
                                         allow_overwrite=True)

  def _progress(self) -> dict[int, dict]:
    """Every process's last report (index -> {"step", "host_s"}); {} if none can be read."""
    try:
      entries = distributed.client().key_value_dir_get(_PROGRESS_KEY)
    except Exception:  # noqa: BLE001  (the coordinator may be gone)
      return {}
    return {int(key.rsplit('/', 1)[1]): json.loads(value) for key, value in entries}

  def _check_stragglers(self, step: int) -> None:
    if not (self.straggler_factor and self._several and jax.process_index() == 0):
      return
    self._report()
    host_s = {i: p['host_s'] for i, p in self._progress().items() if p.get('host_s') is not None}
    for index in stragglers(host_s, self.straggler_factor):
      if (index, step) not in self._warned:
        self._warned.add((index, step))
        others = statistics.median(s for i, s in host_s.items() if i != index)
        logging.warning(
            'Straggler: process %d spends %.0f ms of host time per step (reading data, its own '
            'work; up to step %d), %.1fx the median of the other processes (%.0f ms; all: %s); '
            'its host is slower or busier (train.straggler_factor=%g).', index, 1e3 * host_s[index],
            step, host_s[index] / others if others else float('inf'), 1e3 * others,
            ', '.join(f'{i}: {1e3 * s:.0f} ms' for i, s in sorted(host_s.items())),
            self.straggler_factor)

  def _watch(self) -> None:
    while True:
      if self._several:
        self._report()
      if self._stop.wait(REPORT_EVERY_S):
        return
      beat = self.clock.beat
      if self.hang_timeout_s and self._timing and beat is not None and (
          self.clock.now() - beat > self.hang_timeout_s):
        self._hung()
        return

  def _blame(self, step: int) -> str:
    """Which processes this one waits for, from their reports."""
    progress, now = self._progress(), time.time()
    me = jax.process_index()
    silent = sorted(set(range(jax.process_count())) - set(progress) - {me})
    stale = {i: p for i, p in progress.items() if i != me and now - p['time'] > STALE_S}
    behind = {i: p for i, p in progress.items() if i not in stale and p['step'] < step}
    parts = [f'process {i} stopped responding (its last report, at step {p["step"]}, came '
             f'{now - p["time"]:.0f} s ago)' for i, p in sorted(stale.items())]
    parts += [f'process {i} is behind (at step {p["step"]})' for i, p in sorted(behind.items())]
    parts += [f'process {i} never reported its progress' for i in silent]
    return '; '.join(parts) if parts else f'every process is at step {step} and waits'

  def _hung(self) -> None:
    step = self._step
    stacks = dump_stacks(self.workdir)
    blame = f': {self._blame(step)}' if self._several else ''
    message = (
        f'the run has made no progress for {self.hang_timeout_s:g} s (train.hang_timeout_s) '
        f'since it dispatched step {step}{blame}. Python stacks: {stacks.parent}/. A collective '
        'that never completes usually means a process stopped or its host failed, a wait for '
        'data a dead source; rerun the same command to resume from the last checkpoint, or raise '
        'train.hang_timeout_s if steps are that slow.')
    if self._several:
      distributed.fail_run(message, 1)
    # One process: the main thread is stuck, so this thread ends the process itself.
    print(f'error: {message}', file=sys.stderr, flush=True)
    os._exit(1)  # pylint: disable=protected-access
