"""The one protocol the step loop calls its hooks by, and the two hooks with no module of their
own: the checkpoints (the workdir's Checkpointer adapted) and the held-out evaluation.

Each step the loop (engine/train/loop.py, `StepLoop`) calls every hook in its list order:
`before_dispatch`, then the step is dispatched, then `after_dispatch` (its outputs still on the
device: no host sync). If any hook `wants_sync` at that step, the host waits for the step and
calls every hook's `at_sync` (the time spent there stays out of the throughput). When the loop
ends, finished, preempted or failed, every hook's `close` is called once, the last hook first.

So the list order is the loop's only ordering: the finiteness guard comes before the evaluation,
the sampler and the checkpoints, so that a step that is not finite is never evaluated, sampled or
saved (`loop.loop_hooks` builds the list).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import numpy as np

from engine import data
from engine.distributed import startup as distributed


class Hook:
  """A no-op at every point of the loop; a hook overrides the points it needs.

  `step` is the step's number (1 for the first step of a fresh run), `state` the train state
  after it (a dict of device arrays: 'params', ...), `metrics` its scalars on the device ('loss',
  'grad_norm', 'learning_rate', ...). `stopping`: the run stops after this step (a preemption),
  with a checkpoint of it."""

  # The cause of badput (engine/train/goodput.py) its `at_sync` time is; None: productive.
  badput_cause: str | None = None

  def before_dispatch(self, step: int, state) -> None:
    """Just before the step is dispatched; `state` is the one it starts from."""

  def after_dispatch(self, step: int, state, metrics) -> None:
    """Just after the step is dispatched; fetching `metrics` here would stall the device."""

  def wants_sync(self, step: int, stopping: bool) -> bool:
    """Whether the host should wait for this step and call `at_sync` (evaluate, save, ...)."""
    del step, stopping
    return False

  def at_sync(self, step: int, state, stopping: bool) -> None:
    """At a step some hook wants a sync at, once the step is done; each hook does what is due of
    its own (the others are called too)."""

  def close(self, error: BaseException | None) -> None:
    """Once, when the loop ends; `error` is what stopped it (None: it finished, or stopped
    cleanly at a preemption)."""


def close_all(hooks: list[Hook], error: BaseException | None) -> None:
  """Closes every hook once, the last first. After `error` a hook's own failure is dropped (the
  error that stopped the run is the one reported); otherwise the first failure is raised once
  every hook is closed, and the hooks after it close as after an error."""
  failure = None
  for hook in reversed(hooks):
    try:
      hook.close(error)
    except Exception as raised:  # pylint: disable=broad-except
      if error is None:
        error = failure = raised
  if failure is not None:
    raise failure


class Evaluation(Hook):
  """The eval step on the same fixed held-out batches every time, so losses compare: at every
  train.eval_every-th step and the last, not at a preemption's."""

  badput_cause = 'evaluation'

  def __init__(self, run, eval_step, *, guard, writer, result):
    config = run.config
    self.every, self.num_steps = config.train.eval_every, config.train.num_steps
    self.eval_step = eval_step
    self.batches = [
        data.to_global(b, run.setup.batch_sharding(), config.data.global_batch_size)
        for b in data.eval_batches(run.corpus, config.data, config.seed,
                                   config.train.eval_batches)]
    self.guard, self.writer, self.result = guard, writer, result

  def loss(self, params) -> float:
    return float(np.mean([self.eval_step(params, b) for b in self.batches]))

  def wants_sync(self, step: int, stopping: bool) -> bool:
    return (step % self.every == 0 or step == self.num_steps) and not stopping

  def at_sync(self, step: int, state, stopping: bool) -> None:
    if not self.wants_sync(step, stopping):
      return
    eval_loss = self.loss(state['params'])
    self.guard.stop_if_not_finite(step, {'eval loss': eval_loss})
    self.writer.log_eval(step, eval_loss)
    self.result.eval_losses[step] = eval_loss


class Checkpoints(Hook):
  """The workdir's Checkpointer (engine/workdir/checkpoint.py) as a hook: a save every
  train.checkpoint_every steps, and of the last step or a preemption's; and the local tier's
  (`local`, engine/workdir/checkpoint_tiers.py) every train.local_checkpoint_every steps where the
  workdir's is not due."""

  badput_cause = 'checkpoints'

  def __init__(self, checkpointer, train_iterator, num_steps: int, local=None):
    self.checkpointer, self.train_iterator = checkpointer, train_iterator
    self.num_steps, self.local = num_steps, local

  def _forced(self, step: int, stopping: bool) -> bool:
    return step == self.num_steps or stopping

  def wants_sync(self, step: int, stopping: bool) -> bool:
    return self.checkpointer.is_due(step, force=self._forced(step, stopping)) or (
        self.local is not None and self.local.is_due(step))

  def at_sync(self, step: int, state, stopping: bool) -> None:
    if not self.checkpointer.save(step, state, self.train_iterator,
                                  force=self._forced(step, stopping)) and self.local is not None:
      self.local.save(step, state, self.train_iterator)

  def close(self, error: BaseException | None) -> None:
    """Waits for the saves in flight (raising if the last failed). After a failed collective
    (a JaxRuntimeError: another process has probably stopped) the distributed runtime ends the
    process; the saves are left as they are, and a resumed run removes what they left."""
    for checkpointer in filter(None, (self.local, self.checkpointer)):
      if error is None:
        checkpointer.close()
      elif not isinstance(error, jax.errors.JaxRuntimeError):
        close_quietly(checkpointer)


def close_quietly(checkpointer) -> None:
  """After a failure: saves in flight are of earlier, finite steps, so let them finish, quietly,
  so that the error that stopped the run is the one reported. With several processes, wait no
  longer than the heartbeat timeout: the others may have stopped, and the error comes first."""

  def close():
    with contextlib.suppress(Exception):
      checkpointer.close()

  if not distributed.is_active():
    close()
    return
  closer = threading.Thread(target=close, name='checkpoint_close', daemon=True)
  closer.start()
  closer.join(timeout=distributed.heartbeat_timeout_s())
