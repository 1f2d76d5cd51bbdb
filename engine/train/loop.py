"""The training loop, in four phases: the start (the workdir's checkpoint to resume, or a fresh
state: engine/workdir/resume.py), the compiled steps, the step loop, the final report.

Everything before the first phase (validation, data, the model laid out on the mesh) is
engine.assemble's. The step loop times each step's phases on one clock (engine/train/clock.py),
which throughput, goodput and the watchdog read, and calls its hooks by one protocol
(engine/train/hooks.py), in the order `loop_hooks` gives: the step profiler, the finiteness guard
(engine/train/finiteness.py), the evaluation, the sampler, the checkpoints, the deferred metrics
(engine/train/metrics.py) and the watchdog. The preemption watch is asked after every step
whether to stop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging

from engine import data
from engine.assemble import Run, assemble
from engine.distributed import startup as distributed
from engine.runtime.progress import phase
from engine.train import goodput as goodput_lib
from engine.train.clock import LoopClock
from engine.train.finiteness import FinitenessGuard
from engine.train.hooks import Checkpoints, Evaluation, Hook, close_all
from engine.train.metrics import DeferredMetrics, MetricsWriter, log_memory
from engine.train.preemption import PreemptionWatch
from engine.train.profiling import StepProfiler
from engine.train.samples import Sampler
from engine.train.watchdog import Watchdog
from engine.workdir import resume
from engine.workdir import summary as run_summary


@dataclasses.dataclass
class TrainResult:
  """What a run reports back, by logged step: train losses (that step's own, which parity
  tests compare against a reference) and their means over the steps since the previous logged
  step (what the log, metrics.jsonl and TensorBoard show as train/loss), gradient norms (before
  clipping); eval losses, the last step, compiled memory, summary.json's contents."""
  train_losses: dict[int, float]
  train_grad_norms: dict[int, float]
  eval_losses: dict[int, float]
  final_step: int
  memory: dict[str, dict[str, int]]
  preempted: bool = False  # Stopped early by SIGTERM / SIGINT, with a checkpoint.
  # Steps whose loss or gradient norm was not finite and whose update was not applied
  # (train.skip_nonfinite_steps > 0).
  skipped_steps: list[int] = dataclasses.field(default_factory=list)
  # Mean of the finite per-step losses of the steps (previous logged step, this one].
  train_interval_losses: dict[int, float] = dataclasses.field(default_factory=dict)
  summary: dict | None = None  # WORKDIR/summary.json's contents (process 0 only).


def loop_hooks(*, profiler: StepProfiler, guard: FinitenessGuard, evaluation: Hook,
               sampler: Hook, checkpoints: Hook, metrics: Hook, watchdog: Hook) -> list[Hook]:
  """The loop's hooks in the order they are called (engine/train/hooks.py), closed in reverse.

  The guard comes before the evaluation, the sampler and the checkpoints: a step that is not
  finite is never evaluated, sampled or saved; and before the metrics, which never log a step
  that stopped the run. The profiler comes first, so that its trace ends with the step; the
  metrics next, so that they close first: the final log line comes before the last save's wait;
  the watchdog last: it follows the step once the others are done, and stops before the final
  waits.
  """
  return [profiler, guard, evaluation, sampler, checkpoints, metrics, watchdog]


def global_batches(run: Run, train_iterator):
  """The train iterator's batches laid out on the mesh, one per step, read as the loop asks."""
  batch_sharding, size = run.setup.batch_sharding(), run.config.data.global_batch_size
  return (data.to_global(batch, batch_sharding, size) for batch in train_iterator)


@dataclasses.dataclass(kw_only=True)
class StepLoop:
  """The steps from the initial state to `num_steps` (or a preemption), each calling the hooks
  in list order (engine/train/hooks.py) and timed on `clock` in phases: `data`, `device` (the
  dispatch, and the waits for the devices), and each hook's work at a sync point under its
  badput cause (`sync` for work that is training's own). Once it ends, however it ends, every
  hook is closed, the last first."""
  num_steps: int
  batches: Iterator  # The global batch of each step.
  train_step: Callable  # Compiled: (state, batch) -> (state, metrics).
  preemption: PreemptionWatch
  clock: LoopClock
  result: TrainResult
  hooks: list[Hook]  # In the order of loop_hooks.

  def __call__(self, state, start_step: int) -> None:
    try:
      self._steps(state, start_step)
    except BaseException as error:
      if isinstance(error, jax.errors.JaxRuntimeError):
        distributed.await_failure_report()
      close_all(self.hooks, error)
      raise
    finally:
      # The signals go back before a finished run's last save is waited for (a SIGTERM there
      # stops at once, as outside a run), after a failed run's saves were left to finish.
      self.preemption.close()
    with self.clock.phase('checkpoints'):  # Mostly the wait for the last save.
      close_all(self.hooks, None)

  def _steps(self, state, start_step: int) -> None:
    # Gloo's CPU collectives across processes hang with two steps in flight (several processes
    # on CPU devices); there, the next step is dispatched only once this one is done.
    # Accelerators keep the overlap.
    lockstep = jax.process_count() > 1 and jax.default_backend() == 'cpu'
    clock = self.clock
    clock.start()
    for step in range(start_step + 1, self.num_steps + 1):
      with clock.phase('data'):
        tokens = next(self.batches)
      for hook in self.hooks:
        hook.before_dispatch(step, state)
      with clock.phase('device'):
        state, metrics = self.train_step(state, tokens)
        if lockstep:
          jax.block_until_ready(state)
      for hook in self.hooks:
        hook.after_dispatch(step, state, metrics)
      stopping = self.preemption.stop_after(step)
      if any(hook.wants_sync(step, stopping) for hook in self.hooks):
        # The step itself counts towards throughput; the eval, the sample and the save do not.
        with clock.phase('device'):
          jax.block_until_ready(state)
        for hook in self.hooks:
          with clock.phase(hook.badput_cause or 'sync'):
            hook.at_sync(step, state, stopping)
      self.result.final_step = step
      if stopping:
        break


def compile_steps(run: Run, memory: dict) -> tuple:
  """The train and eval steps compiled for the run's abstract state and batch (memory stats
  logged and kept)."""
  with phase('the train step'):
    train_step = run.compile_train_step()
  memory['train_step'] = log_memory('train step', train_step)
  with phase('the eval step'):
    eval_step = run.compile_eval_step()
  return train_step, eval_step


def _final_report(config, start: resume.Start, preemption: PreemptionWatch,
                  result: TrainResult) -> None:
  blocked_s = start.checkpointer.blocked_s
  if blocked_s:
    logging.info('Checkpoints: %d saved (%s), the loop waited median %.0f ms, max %.0f ms per '
                 'save', len(blocked_s),
                 'asynchronously' if config.train.async_checkpoints else 'synchronously',
                 1e3 * np.median(blocked_s), 1e3 * max(blocked_s))
  if preemption.signal_name and result.final_step < config.train.num_steps:
    logging.info('Stopped by %s after step %d of %d; its checkpoint is in %s. Rerun the same '
                 'command to resume.', preemption.signal_name, result.final_step,
                 config.train.num_steps, start.checkpointer.directory)
    result.preempted = True


def train(config: ml_collections.ConfigDict, workdir: str,
          started: float | None = None) -> TrainResult:
  """Trains (or resumes) the experiment `config` in `workdir` (a local path or gs://...);
  `started`: when the command started (time.time(); default now), for the goodput."""
  started = time.time() if started is None else started
  run = assemble(config)
  sampler = Sampler(run)  # Its prompt is checked here, before anything is written.
  with resume.held(workdir, config.train.compile_cache_dir) as (workdir, compiled):
    return _train(run, workdir, sampler, compiled, started)


def _train(run: Run, workdir, sampler: Sampler, compiled, started: float) -> TrainResult:
  """The loop's phases, in a workdir this run holds."""
  config = run.config
  for line in run.describe():
    logging.info('%s', line)
  train_iterator = data.train_iterator(run.corpus, config.data, config.seed)
  start = resume.find_start(run, workdir)
  finished = resume.finished(config, start, workdir)
  if finished:
    start.close()
    logging.info('%s', finished)
    return TrainResult({}, {}, {}, start.step, {})
  state, start_step, init_compiled = resume.initial_state(run, start, train_iterator)
  memory = {} if init_compiled is None else {'init': log_memory('init', init_compiled)}
  train_step, eval_step = compile_steps(run, memory)
  logging.info('Compilation: %s', compiled.describe())
  resume.record_start(run, workdir)
  num_steps, clock = config.train.num_steps, LoopClock()
  writer = _metrics_writer(run, workdir, start_step, clock)
  peak_memory = run_summary.PeakMemory(memory['train_step'].get('peak_estimate_bytes'))
  result = TrainResult({}, {}, {}, start_step, memory)
  goodput = goodput_lib.Goodput(workdir, start_step, started, clock)
  guard = FinitenessGuard(config.train.skip_nonfinite_steps, start.checkpointer, workdir)
  result.skipped_steps = guard.skipped
  preemption = PreemptionWatch()
  loop = StepLoop(
      num_steps=num_steps, batches=global_batches(run, train_iterator), train_step=train_step,
      preemption=preemption, clock=clock, result=result,
      hooks=loop_hooks(
          profiler=StepProfiler(config.train.profile_steps, num_steps, start_step, workdir),
          guard=guard,
          evaluation=Evaluation(run, eval_step, guard=guard, writer=writer, result=result),
          sampler=sampler,
          checkpoints=Checkpoints(start.checkpointer, train_iterator, num_steps, start.local),
          metrics=DeferredMetrics(writer, result, config.train.log_every, num_steps, peak_memory,
                                  goodput),
          watchdog=Watchdog(workdir, config.train.hang_timeout_s, config.train.straggler_factor,
                            config.train.log_every, start_step, clock)))
  try:
    loop(state, start_step)
  finally:  # A failed attempt's time counts too.
    totals = goodput.update(result.final_step, final=True)
  _final_report(config, start, preemption, result)
  logging.info('Goodput: %s', goodput_lib.describe(totals))
  writer.close()
  result.summary = run_summary.write(
      workdir, status='preempted' if result.preempted else 'finished',
      final_step=result.final_step, num_steps=num_steps, peak_memory=peak_memory.read(),
      wall_s=time.time() - started, mode=config.parallelism.mode,
      mesh=run_summary.mesh_string(dict(run.setup.mesh.shape)), model=run.setup.model.name,
      goodput=totals, compilation=compiled.record())
  writer.end_run(result.summary)
  return result


def _metrics_writer(run: Run, workdir, start_step: int, clock: LoopClock) -> MetricsWriter:
  """The run's metrics writer: its loggers (train.loggers), tokens and FLOPs per step, the
  devices' peak for MFU, the loop's clock."""
  config = run.config
  return MetricsWriter(workdir, config.train.num_steps,
                       config.data.global_batch_size * config.data.seq_len,
                       run.setup.model.flops_per_token(config.data.seq_len), start_step,
                       run_summary.peak_flops_of_devices(
                           jax.devices()[0].device_kind, config.model.dtype, run.setup.mesh.size),
                       clock=clock, config=config)
