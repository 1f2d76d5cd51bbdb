"""Progress lines of long work (engine/runtime/progress.py) on a fake clock: a phase's start and
time, a loop's rate limit, time left and last line; and where the commands use them without
compiling: evaluate's batches, the plan's candidates, a sweep's running variant."""

import json
import logging
import subprocess
import types

import numpy as np
import pytest

from engine.evaluate import scoring
from engine.plan import planner
from engine.runtime import progress
from engine.sweep import runner
from tests.support.helpers import tiny_config


class FakeClock:
  """Seconds that pass only when a test says so."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


@pytest.fixture
def lines(caplog):
  """The absl INFO messages logged so far (on the absl logger itself: an earlier test in the
  session may have lowered absl's verbosity)."""
  caplog.set_level(logging.INFO, logger='absl')
  return lambda: [r.getMessage() for r in caplog.records if r.name == 'absl']


def test_durations_read_as_seconds_then_minutes():
  assert [progress.duration(s) for s in (3.14, 42.4, 125.2, 3600)] == [
      '3.1 s', '42 s', '2 min 05 s', '60 min 00 s']


def test_a_phase_logs_its_start_and_its_time(lines):
  clock = FakeClock()
  with progress.phase('the train step', clock=clock) as timer:
    assert lines() == ['Compiling the train step ...']
    clock.now = 12.34
  assert timer.seconds == pytest.approx(12.34)
  assert lines()[1:] == ['Compiled the train step in 12 s.']


def test_a_failed_phase_keeps_its_time_and_claims_no_end(lines):
  clock = FakeClock()
  with pytest.raises(RuntimeError), progress.phase('the reference', 'Building', 'Built',
                                                   clock=clock) as timer:
    clock.now = 2.0
    raise RuntimeError('out of memory')
  assert timer.seconds == 2.0 and lines() == ['Building the reference ...']


def _loop(progress_class, lines) -> list[str]:
  """40 items, the first taking 10 s (it compiles) and each other 1 s, reported every 5 s."""
  clock = FakeClock()
  loop = progress_class(40, 'Scoring', 'batch', every_s=5, clock=clock)
  for i in range(40):
    clock.now += 10 if i == 0 else 1
    loop.update()
  loop.finish()
  return lines()


class _EtaFromTheStart(progress.Progress):
  """A planted bug: the time left measured from the start, the first item's compile included."""

  def _time_left(self, now):
    return f', ETA {progress.duration((now - self._start) / self.done * (self.total - self.done))}'


def _expected_lines():
  # Logged at 10 s (no rate yet), then every 5 s: at item k the time is 9 + k s, and the time
  # left is (40 - k) items of 1 s each.
  periodic = [f'Scoring: batch {k}/40, {progress.duration(9 + k)} elapsed, ETA '
              f'{progress.duration(40 - k)}' for k in range(6, 40, 5)]
  return (['Scoring: batch 1/40, 10 s elapsed'] + periodic +
          ['Scoring: batch 40/40 done in 49 s.'])


def test_a_loop_logs_at_most_every_few_seconds_with_the_time_left(lines):
  assert _loop(progress.Progress, lines) == _expected_lines()


def test_the_time_left_check_catches_a_rate_that_counts_the_first_compile(lines):
  assert _loop(_EtaFromTheStart, lines) != _expected_lines()


def test_evaluate_logs_its_batches(monkeypatch, lines):
  """window_losses with a stand-in program whose first call takes 20 s and each other 3 s."""
  clock = FakeClock()
  monkeypatch.setattr(progress, 'time', types.SimpleNamespace(perf_counter=clock))

  def program(params, batch):
    clock.now += 3 if clock.now else 20
    return np.full(len(batch), 2.0), np.ones(len(batch), int)

  setup = types.SimpleNamespace(mesh=types.SimpleNamespace(shape={'data': 1}),
                                rules=types.SimpleNamespace(mesh_axes=lambda *_: ('data',)))
  steps = types.SimpleNamespace(window_losses=program)
  sums, _ = scoring.window_losses(setup, None, np.zeros((10, 5), int), 1, steps)
  assert sums.tolist() == [2.0] * 10
  assert lines() == ['Scoring: batch 1/10, 20 s elapsed',
                     'Scoring: batch 3/10, 26 s elapsed, ETA 21 s',
                     'Scoring: batch 5/10, 32 s elapsed, ETA 15 s',
                     'Scoring: batch 7/10, 38 s elapsed, ETA 9.0 s',
                     'Scoring: batch 9/10, 44 s elapsed, ETA 3.0 s',
                     'Scoring: batch 10/10 done in 47 s.']


def test_the_plan_names_each_candidate_of_how_many(monkeypatch):
  places = []

  def candidate(config, mode, devices, hardware, place, memory_breakdown=False):
    places.append((mode, place))
    return {'status': 'fits', 'roofline': {'serial_s': 1.0}}

  chip = types.SimpleNamespace(name='chip')
  hardware = types.SimpleNamespace(chip=chip, num_devices=8, devices_per_chip=1, hbm_bytes=1,
                                   dcn_gb_per_s=1.0, host_gb_per_s=1.0)
  monkeypatch.setattr(planner, 'topology_devices', lambda *_: [])
  monkeypatch.setattr(planner.Hardware, 'of', lambda *_: hardware)
  monkeypatch.setattr(planner, 'plan_candidate', candidate)
  planner.plan(tiny_config(), 'v5p:2x2x2', 1, ['auto', 'manual'], ['8x1x1', '1x8x1'])
  assert places == [('auto', 'candidate 1 of 4'), ('manual', 'candidate 2 of 4'),
                    ('auto', 'candidate 3 of 4'), ('manual', 'candidate 4 of 4')]


class _Child:
  """A stand-in for the variant's process: at each wait that times out, the run has logged the
  next of `steps` (None: nothing yet) to its metrics.jsonl; then it ends."""

  def __init__(self, metrics, clock, steps):
    self.metrics, self.clock, self.steps = metrics, clock, list(steps)

  def wait(self, timeout):
    self.clock.now += timeout
    if not self.steps:
      return 0
    if (step := self.steps.pop(0)) is not None:
      with open(self.metrics, 'a') as f:
        f.write(json.dumps({'step': step, 'train/loss': 1.0}) + '\n')
    raise subprocess.TimeoutExpired('engine.main', timeout)


def test_a_sweep_logs_its_running_variants_step_and_time_left(monkeypatch, tmp_path, lines):
  """A resumed variant, polled every 5 s: its file ends at step 60 of the earlier attempt, then
  (compiled, resumed from step 20) it logs a step every 5 s, 1 s a step. Every 15 s: its step
  and time left, never the earlier attempt's step (which would hide the new ones below it), and
  not the last (the sweep's `finished` line says it)."""
  clock = FakeClock()
  monkeypatch.setattr(progress, 'time', types.SimpleNamespace(perf_counter=clock))
  metrics = tmp_path / 'metrics.jsonl'
  metrics.write_text(json.dumps({'step': 20}) + '\n' + json.dumps({'step': 60}) + '\n')
  child = _Child(metrics, clock, [None, 25, 30, 35, 40, 45, 50, 100])
  assert runner.wait_reporting(child, str(tmp_path), 100, '[1/2] lr=1e-3', every_s=15,
                               poll_s=5) == 0
  assert lines() == ['[1/2] lr=1e-3: step 30/100, 15 s elapsed, ETA 1 min 10 s',
                     '[1/2] lr=1e-3: step 45/100, 30 s elapsed, ETA 55 s']


def test_a_sweep_reads_the_last_complete_line_of_a_long_file(tmp_path):
  records = [json.dumps({'step': i, 'train/loss': 1.0}) for i in range(1, 3001)]
  (tmp_path / 'metrics.jsonl').write_text('\n'.join(records) + '\n{"step": 30')  # Half written.
  assert runner._last_step(str(tmp_path)) == 3000
  assert runner._last_step(str(tmp_path / 'not_started')) is None
