"""The loop's one clock: each part of a step timed once, read by everything that needs time.

The step loop (engine/train/loop.py) runs each step in phases on this clock: `data` (waiting for
the next batch), `device` (dispatching the step, and waiting for the devices where the loop must)
and, at a sync point, each hook's work under its cause of badput (`checkpoints`, `evaluation`;
`sync` for work that counts as training). Three readers take what they need from it:

  throughput, MFU (engine/train/metrics.py)  the time between log points less the sync phases
  goodput (engine/train/goodput.py)          the loop's start and the badput causes' seconds
  the watchdog (engine/train/watchdog.py)    the last beat (the end of the last phase: the main
                                             thread's last progress) and the host's own time
                                             (all but `device`)
"""

from __future__ import annotations

import collections
import contextlib
import time

# The phases of the step itself; any other is work at a sync point, outside the throughput.
STEP_PHASES = ('data', 'device')


class LoopClock:
  """Monotonic seconds by phase since the clock was made; `now` and `wall` are injectable for
  tests (the wall clock dates goodput's records, which outlive the process)."""

  def __init__(self, now=time.monotonic, wall=time.time):
    self.now, self.wall = now, wall
    self.seconds: dict[str, float] = collections.defaultdict(float)
    self.started = self.started_wall = None  # The loop's start (`start`).
    self.beat: float | None = None  # When the main thread last finished a phase.
    self.current: str | None = None  # The phase under way.

  def start(self) -> None:
    """The loop is about to read its first batch: everything before was start-up."""
    self.started, self.started_wall = self.now(), self.wall()
    self.beat = self.started

  @contextlib.contextmanager
  def phase(self, name: str):
    """Time inside is `name`'s; its end is a beat."""
    start, self.current = self.now(), name
    try:
      yield
    finally:
      end = self.now()
      self.seconds[name] += end - start
      self.beat, self.current = end, None

  def outside_steps(self) -> float:
    """Seconds spent in sync phases so far (evaluations, saves, samples, ...)."""
    return sum(s for name, s in self.seconds.items() if name not in STEP_PHASES)
