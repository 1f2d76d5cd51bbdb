"""Progress lines for work that takes more than a few seconds: a phase's start and its end with
the time it took (`phase`), and a loop's count with the time elapsed and left (`Progress`), at
most one line every few seconds. They go through absl's logging.info, so `--verbosity=-1`
(warnings and errors only) silences them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from absl import logging


def duration(seconds: float) -> str:
  """'3.1 s', '42 s', '2 min 05 s'."""
  if seconds < 10:
    return f'{seconds:.1f} s'
  if seconds < 60:
    return f'{seconds:.0f} s'
  minutes, rest = divmod(round(seconds), 60)
  return f'{minutes} min {rest:02d} s'


class Timer:
  """What `phase` yields: the phase's seconds, set once it ends (also when it fails)."""
  seconds: float | None = None


@contextlib.contextmanager
def phase(what: str, doing: str = 'Compiling', done: str = 'Compiled',
          clock: Callable[[], float] | None = None) -> Iterator[Timer]:
  """Logs 'Compiling WHAT ...' on entry and 'Compiled WHAT in 12.3 s.' when it ends without an
  error (a failure is reported by whoever catches it). Yields a Timer with the seconds taken."""
  logging.info('%s %s ...', doing, what)
  clock = clock or time.perf_counter  # Looked up now, so that a test can stand in for it.
  timer, start = Timer(), clock()
  try:
    yield timer
  finally:
    timer.seconds = clock() - start
  logging.info('%s %s in %s.', done, what, duration(timer.seconds))


class Progress:
  """A loop of `total` items: `update()` after each (or `update(done)` with the count so far)
  logs 'WHAT: UNIT 12/40, 3.1 s elapsed, ETA 7.0 s' at most every `every_s` seconds; `finish()`
  logs the last line, 'WHAT: UNIT 40/40 done in 12.3 s.'. The time left is measured from the
  first update on, so that a first item that compiles does not inflate it."""

  def __init__(self, total: int, what: str, unit: str, every_s: float = 5.0,
               clock: Callable[[], float] | None = None):
    self.total, self.what, self.unit, self.every_s = total, what, unit, every_s
    self._clock = clock or time.perf_counter
    self._start = self._logged = self._clock()
    self._first: tuple[int, float] | None = None  # (count, time) of the first update.
    self.done = 0

  def update(self, done: int | None = None) -> None:
    self.done = self.done + 1 if done is None else done
    now = self._clock()
    if self._first is None:
      self._first = (self.done, now)
    if now - self._logged < self.every_s or self.done >= self.total:
      return  # Too soon, or finish() says the end.
    self._logged = now
    logging.info('%s: %s %d/%d, %s elapsed%s', self.what, self.unit, self.done, self.total,
                 duration(now - self._start), self._time_left(now))

  def _time_left(self, now: float) -> str:
    first_done, first_time = self._first
    if self.done <= first_done:
      return ''
    per_item = (now - first_time) / (self.done - first_done)
    return f', ETA {duration(per_item * (self.total - self.done))}'

  def finish(self) -> None:
    logging.info('%s: %s %d/%d done in %s.', self.what, self.unit, self.done, self.total,
                 duration(self._clock() - self._start))
