"""The step loop's hooks (engine/train/hooks.py) on a train step of plain Python: the order they
are called in, the finiteness guard before whatever syncs on a step, and every hook closed once
however the loop ends."""

import numpy as np
import pytest

from engine.train.clock import LoopClock
from engine.train.finiteness import FinitenessGuard, NonFiniteError
from engine.train.hooks import Hook, close_all
from engine.train.loop import StepLoop, TrainResult, loop_hooks


class Recorder(Hook):
  """Appends (name, point, step or error) to a log the recorders share; wants a sync every
  `sync_every` steps (0: never)."""

  def __init__(self, name, log, sync_every=0, fail_to_close=False):
    self.name, self.log, self.sync_every = name, log, sync_every
    self.fail_to_close = fail_to_close

  def before_dispatch(self, step, state):
    self.log.append((self.name, 'before_dispatch', step))

  def after_dispatch(self, step, state, metrics):
    self.log.append((self.name, 'after_dispatch', step))

  def wants_sync(self, step, stopping):
    return bool(self.sync_every) and step % self.sync_every == 0

  def at_sync(self, step, state, stopping):
    self.log.append((self.name, 'at_sync', step))

  def close(self, error):
    self.log.append((self.name, 'close', error))
    if self.fail_to_close:
      raise OSError(f'{self.name} failed to close')


class RecordedGuard(FinitenessGuard):
  """The real guard, its checks logged."""

  def __init__(self, log, skip_limit):
    super().__init__(skip_limit, NoCheckpoints(), 'workdir')
    self.log = log

  def check(self, step, metrics):
    self.log.append(('guard', 'check', step))
    super().check(step, metrics)


class NoCheckpoints:
  """What the guard asks of a checkpointer when it stops a run."""

  def latest_step(self):
    return None

  def close(self):
    pass


class NoPreemption:

  def __init__(self):
    self.closed = 0

  def stop_after(self, step):
    return False

  def close(self):
    self.closed += 1


def train_step(losses, fail_at=None):
  """A step whose loss is losses.get(step, 1.0); it raises at step `fail_at`."""

  def step_fn(state, batch):
    del batch
    step = state['step'] + 1
    if step == fail_at:
      raise RuntimeError(f'step {step} failed')
    metrics = {'loss': np.float32(losses.get(step, 1.0)), 'grad_norm': np.float32(1.0),
               'learning_rate': np.float32(1e-3)}
    return {'step': step, 'params': {}}, metrics

  return step_fn


def run_loop(hooks, num_steps, step_fn, preemption=None):
  loop = StepLoop(num_steps=num_steps, batches=iter(range(num_steps)), train_step=step_fn,
                  preemption=preemption or NoPreemption(), clock=LoopClock(),
                  result=TrainResult({}, {}, {}, 0, {}), hooks=hooks)
  loop({'step': 0, 'params': {}}, 0)
  return loop.result


def test_every_hook_sees_every_step_in_order_and_closes_once_last_first():
  log = []
  hooks = [Recorder('a', log), Recorder('b', log, sync_every=2), Recorder('c', log)]
  result = run_loop(hooks, 3, train_step({}))
  assert result.final_step == 3
  expected = []
  for step in (1, 2, 3):
    expected += [(name, 'before_dispatch', step) for name in 'abc']
    expected += [(name, 'after_dispatch', step) for name in 'abc']
    if step == 2:  # One hook wants a sync: every hook's at_sync is called, in order.
      expected += [(name, 'at_sync', step) for name in 'abc']
  expected += [(name, 'close', None) for name in 'cba']
  assert log == expected


@pytest.mark.parametrize('skip_limit', [0, 1])
def test_the_guard_checks_a_step_before_it_is_evaluated_sampled_or_saved(skip_limit):
  """In the loop's own order (loop_hooks), at a step where the evaluation and the checkpoints
  sync: a step that is not finite stops the run before either sees it, or, skipped, is checked
  before either runs; the metrics never log the step that stopped the run."""
  log = []
  names = ('profiler', 'evaluation', 'sampler', 'checkpoints', 'metrics', 'watchdog')
  recorders = {name: Recorder(name, log, sync_every=2 if name in ('evaluation', 'checkpoints')
                              else 0) for name in names}
  guard = RecordedGuard(log, skip_limit)
  hooks = loop_hooks(guard=guard, **recorders)
  assert hooks.index(guard) < min(hooks.index(recorders[n]) for n in names[1:])
  step_fn = train_step({2: float('nan')})
  if not skip_limit:
    with pytest.raises(NonFiniteError, match='Step 2: the train loss is nan'):
      run_loop(hooks, 4, step_fn)
    assert not [entry for entry in log if entry[1] == 'at_sync' and entry[0] != 'profiler']
    closed = [entry for entry in log if entry[1] == 'close']
    assert [name for name, _, _ in closed] == list(reversed(names))
    assert all(isinstance(error, NonFiniteError) for _, _, error in closed)
    return
  run_loop(hooks, 4, step_fn)
  assert guard.skipped == [2]
  for step in (2, 4):
    synced = log.index(('guard', 'check', step))
    assert synced < log.index(('evaluation', 'at_sync', step))
    assert synced < log.index(('checkpoints', 'at_sync', step))


def test_a_loop_that_raises_closes_every_hook_once_and_reports_its_own_error():
  log = []
  hooks = [Recorder('a', log), Recorder('b', log, fail_to_close=True), Recorder('c', log)]
  preemption = NoPreemption()
  with pytest.raises(RuntimeError, match='step 3 failed') as raised:
    run_loop(hooks, 5, train_step({}, fail_at=3), preemption)
  closed = [entry for entry in log if entry[1] == 'close']
  assert closed == [(name, 'close', raised.value) for name in 'cba']
  assert preemption.closed == 1


def test_a_hook_that_fails_to_close_makes_the_rest_close_as_after_an_error():
  log = []
  hooks = [Recorder('a', log), Recorder('b', log, fail_to_close=True), Recorder('c', log)]
  with pytest.raises(OSError, match='b failed to close') as raised:
    close_all(hooks, None)
  assert log == [('c', 'close', None), ('b', 'close', None), ('a', 'close', raised.value)]
