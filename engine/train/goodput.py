"""Goodput: the share of a run's wall time that went into productive training steps, and where
the rest (the badput) went, over every attempt of the run (a resumed run adds up its attempts).

Each attempt (one start of the run, until it finishes, is preempted, fails or is killed) records
in WORKDIR/goodput.json, at log points at most every WRITE_EVERY_S and at its end (process 0,
atomically; a bucket is slow to write):

  started, updated        wall-clock times (seconds since the epoch) of its start and last record
  first_step, last_step   the step it started from (a checkpoint's, or 0) and the last it finished
  steps_s                 seconds in its steps: from the first dispatch to `updated`, less the
                          badput below that fell in between
  badput_s                seconds by cause: `startup` (from the command's start to the first
                          step: reading data, restoring, compiling), `checkpoints` (the loop
                          waiting for saves, and for the last at the end), `data` (waiting for
                          the next batch), `evaluation` (held-out evaluations and samples)

and `account` adds the attempts up: the time between one attempt's last record and the next's
start is `stopped` (a crash, a preemption's wait for a new machine, a killed process's last
unrecorded steps); the steps an attempt finished after the checkpoint the next one started from
are `lost_steps` (their share of its steps_s: they ran again). Goodput is the productive steps'
seconds (steps_s less lost_steps) over the wall time from the first start to the last record.
An evaluation or save waits for the steps dispatched before it: that wait (at most the steps in
flight) is counted as theirs, productive.
"""

from __future__ import annotations

import json
import os
import time

import jax
from absl import logging
from etils import epath

from engine.train.clock import LoopClock
from engine.workdir import run_dir

FILE = 'goodput.json'
# Badput by cause, in the order the summary lists them, with the log's words for each.
CAUSES = {'startup': 'start-up and compilation', 'checkpoints': 'checkpoint waits',
          'data': 'data waits', 'evaluation': 'evaluation and samples',
          'lost_steps': 'steps lost to restarts', 'stopped': 'time stopped'}
ATTEMPT_CAUSES = ('startup', 'checkpoints', 'data', 'evaluation')  # Measured within an attempt.
LOOP_CAUSES = ATTEMPT_CAUSES[1:]  # The loop's clock times these, as phases of those names.
WRITE_EVERY_S = 10.0


def account(attempts: list[dict]) -> dict:
  """The run's goodput over `attempts` (goodput.json's, oldest first): the share, the wall
  time, the productive seconds and the badput by cause (CAUSES)."""
  badput = {cause: 0.0 for cause in CAUSES}
  productive = 0.0
  for i, attempt in enumerate(attempts):
    for cause in ATTEMPT_CAUSES:
      badput[cause] += attempt['badput_s'].get(cause, 0.0)
    steps_s = attempt['steps_s']
    if i + 1 < len(attempts):
      after = attempts[i + 1]
      badput['stopped'] += max(0.0, after['started'] - attempt['updated'])
      redone = max(0, attempt['last_step'] - max(after['first_step'], attempt['first_step']))
      done = attempt['last_step'] - attempt['first_step']
      lost = steps_s * redone / done if done > 0 else 0.0
      badput['lost_steps'] += lost
      steps_s -= lost
    productive += steps_s
  wall = attempts[-1]['updated'] - attempts[0]['started'] if attempts else 0.0
  return {'goodput': productive / wall if wall > 0 else None, 'wall_s': wall,
          'productive_s': productive, 'badput_s': badput, 'attempts': len(attempts)}


def describe(totals: dict) -> str:
  """The log's line: goodput, wall time, attempts, and each cause of badput that took time."""
  if totals['goodput'] is None:
    return 'no time recorded'
  attempts = totals['attempts']
  causes = ', '.join(f'{CAUSES[cause]} {seconds:.1f} s'
                     for cause, seconds in totals['badput_s'].items() if seconds >= 0.05)
  return (f'{totals["goodput"]:.1%} of {totals["wall_s"]:.1f} s over {attempts} attempt'
          f'{"s" if attempts > 1 else ""}' + (f'; badput: {causes}' if causes else ''))


def process_started() -> float:
  """When this process started (time.time()'s clock), from /proc where there is one (Python's
  own start-up and imports count as start-up too), else now."""
  try:
    with open('/proc/self/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])  # Field 22: start, in ticks after boot.
    with open('/proc/stat') as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith('btime'))
    return boot + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError, StopIteration):
    return time.time()


def read_attempts(workdir: epath.Path) -> list[dict]:
  """goodput.json's attempts (none if missing or unreadable: goodput never stops a run)."""
  path = workdir / FILE
  try:
    return json.loads(path.read_text())['attempts'] if path.exists() else []
  except (ValueError, KeyError, TypeError, OSError) as error:
    logging.warning('%s is unreadable (%s): goodput counts this attempt from here on.', path,
                    error)
    return []


class Goodput:
  """This attempt's record (module docstring), read off the loop's clock (engine/train/clock.py:
  its phases named as causes are the badput within the loop). `started`: when the command
  started (time.time())."""

  def __init__(self, workdir: epath.Path, start_step: int, started: float, clock: LoopClock):
    self.path, self.clock = workdir / FILE, clock
    self.is_writer = jax.process_index() == 0
    self.earlier = read_attempts(workdir) if self.is_writer else []
    self.attempt = {'started': started, 'updated': clock.wall(), 'first_step': start_step,
                    'last_step': start_step, 'steps_s': 0.0,
                    'badput_s': {cause: 0.0 for cause in ATTEMPT_CAUSES}}
    self._written = None  # When goodput.json was last written.

  def update(self, step: int, final: bool = False) -> dict:
    """Records the attempt as of finished step `step` (written at most every WRITE_EVERY_S,
    and when `final`); returns the run's totals (`account`)."""
    now, clock = self.clock.wall(), self.clock
    self.attempt['updated'], self.attempt['last_step'] = now, step
    if clock.started is not None:
      badput = self.attempt['badput_s']
      badput['startup'] = clock.started_wall - self.attempt['started']
      for cause in LOOP_CAUSES:
        badput[cause] = clock.seconds.get(cause, 0.0)
      in_loop = sum(badput[cause] for cause in LOOP_CAUSES)
      # Wall-clock times, as `started` and `updated` are: the attempt's parts add up to its wall.
      self.attempt['steps_s'] = max(0.0, now - clock.started_wall - in_loop)
    attempts = self.earlier + [self.attempt]
    if self.is_writer and (final or self._written is None or
                           now - self._written >= WRITE_EVERY_S):
      run_dir.write_text_atomically(self.path, json.dumps({'attempts': attempts}, indent=1))
      self._written = now
    return account(attempts)
