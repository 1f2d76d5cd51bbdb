"""A jax.profiler trace of a range of training steps (train.profile_steps=A:B, both included).

Each process traces its own devices: into WORKDIR/profile with one process, into
WORKDIR/profile/process_<i> with several (jax names the trace file after the host, which
processes sharing a host would overwrite). TensorBoard with its profile plugin, or xprof, reads
the directory: `tensorboard --logdir=WORKDIR/profile`. engine.bench --profile traces each variant
with trace_steps.
"""

from __future__ import annotations

import contextlib
import os

import jax
from absl import logging

from engine.config import parse_profile_steps
from engine.train.hooks import Hook


def trace_directory(base) -> str:
  """Where this process's trace goes: `base` itself, or base/process_<i> with several."""
  if jax.process_count() > 1:
    return os.path.join(str(base), f'process_{jax.process_index()}')
  return str(base)


def trace_steps(directory: str, step, state, batches: list):
  """Runs `state, metrics = step(state, batch)` for each batch under a trace into `directory`,
  started once the device is idle and stopped once the last step is done; the final state."""
  state = jax.block_until_ready(state)
  jax.profiler.start_trace(directory)
  try:
    for batch in batches:
      state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
  finally:
    jax.profiler.stop_trace()
  return state


class StepProfiler(Hook):
  """Starts a trace before step `first` is dispatched and stops it once step `last` is done.
  The loop compares each step with two ints; the rest runs twice per run at most.

  A run resumed inside the range traces its remaining steps; one resumed past it traces none;
  one that stops inside it (preempted, or failed) keeps its partial trace."""

  def __init__(self, text: str, num_steps: int, start_step: int, workdir):
    steps = parse_profile_steps(text, num_steps)
    self.first = self.last = -1  # No step matches: nothing traced.
    if steps is not None and start_step < steps[1]:
      self.first, self.last = max(steps[0], start_step + 1), steps[1]
    self.base = str(workdir / 'profile')
    self.directory = trace_directory(self.base) if self.first > 0 else ''
    self.active = False

  def before_dispatch(self, step: int, state) -> None:
    if step == self.first:
      jax.block_until_ready(state)  # Earlier steps' device work stays out of the trace.
      jax.profiler.start_trace(self.directory)
      self.active = True

  def after_dispatch(self, step: int, state, metrics) -> None:
    if step == self.last:
      jax.block_until_ready((state, metrics))  # The trace holds the last step's device work.
      self.stop()
      logging.info('Profiled steps %d to %d into %s; open it with `tensorboard --logdir=%s` '
                   '(pip install tensorboard tensorboard-plugin-profile; the Profile tab).',
                   self.first, self.last, self.directory, self.base)

  def stop(self) -> None:
    """Ends a trace in progress (also when the run stops inside the range)."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()

  def close(self, error: BaseException | None) -> None:
    del error
    with contextlib.suppress(Exception):  # A trace that fails to stop does not fail the run.
      self.stop()
