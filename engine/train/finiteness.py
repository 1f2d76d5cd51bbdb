"""The finiteness guard of the training loop: a step whose loss or gradient norm is not finite
stops the run before anything of it is saved, or, with train.skip_nonfinite_steps = N > 0, is
skipped (the step itself left parameters and optimizer state as they were) up to N in a row.

Each check fetches two scalars; the guard checks a step once the next one is dispatched (no
device stall), and at once at a step the loop syncs at, before it evaluates, samples or
checkpoints it (the guard comes before those hooks in the loop's order).
"""

from __future__ import annotations

import math

import jax
from absl import logging

from engine.train.hooks import Hook


class NonFiniteError(FloatingPointError):
  """A training step (or an evaluation) produced a loss or gradient norm that is not finite."""

  def __init__(self, step: int, values: dict[str, float], last_checkpoint: int | None,
               workdir: str):
    what = ' and '.join(f'the {name} is {value}' for name, value in values.items())
    if last_checkpoint is None:
      kept = 'no checkpoint was written yet, so a rerun starts afresh'
    else:
      kept = (f'the last checkpoint, of step {last_checkpoint}, is untouched in {workdir} and a '
              'rerun resumes from it')
    super().__init__(
        f'Step {step}: {what}. Stopped before saving anything of this step; {kept}. Lower '
        'optim.learning_rate (or lengthen optim.warmup_steps), keep optim.grad_clip_norm on, '
        'compute in float32 (model.dtype), or check the data.')
    self.step, self.values = step, values


class FinitenessGuard(Hook):
  """Checks each step's loss and gradient norm; records the steps it skipped."""

  def __init__(self, skip_limit: int, checkpointer, workdir):
    self.skip_limit = skip_limit
    self.checkpointer, self.workdir = checkpointer, workdir
    self.skipped: list[int] = []
    self._in_a_row = 0
    self._unchecked = None  # (step, metrics) dispatched but not yet checked.

  def after_dispatch(self, step: int, state, metrics) -> None:
    """Checks the previous step (done by now, or nearly) and holds this one back."""
    del state
    if self._unchecked is not None:
      self.check(*self._unchecked)
    self._unchecked = (step, metrics)

  def at_sync(self, step: int, state, stopping: bool) -> None:
    """Checks the step held back at once: the hooks after this one may use it."""
    del state, stopping
    if self._unchecked is not None and self._unchecked[0] == step:
      self.check(*self._unchecked)

  def check(self, step: int, metrics) -> None:
    """Stops at a step that is not finite, or counts it as skipped when such steps are."""
    if self._unchecked is not None and self._unchecked[0] == step:
      self._unchecked = None
    loss, grad_norm = jax.device_get((metrics['loss'], metrics['grad_norm']))
    values = {'train loss': float(loss), 'gradient norm': float(grad_norm)}
    if all(math.isfinite(v) for v in values.values()):
      self._in_a_row = 0
      return
    self._in_a_row += 1
    if self._in_a_row <= self.skip_limit:
      self.skipped.append(step)
      logging.warning('Step %d: %s; skipped (its update was not applied): %d in a row, %d in '
                      'all; train.skip_nonfinite_steps=%d in a row are allowed.', step,
                      ', '.join(f'{k} {v}' for k, v in values.items()), self._in_a_row,
                      len(self.skipped), self.skip_limit)
      return
    self.stop_if_not_finite(step, values)

  def stop_if_not_finite(self, step: int, values: dict[str, float]) -> None:
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
      last_saved = self.checkpointer.latest_step()
      self.checkpointer.close()  # Saves in flight are of earlier, finite steps: let them finish.
      raise NonFiniteError(step, bad, last_saved, self.workdir)
