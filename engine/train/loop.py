"""The training loop, in four phases: the initial state (fresh, another run's parameters, or the
workdir's checkpoint), the compiled steps, the step loop, the final report.

Everything before the first phase (validation, data, the model laid out on the mesh) is
engine.assemble's. The step loop calls its hooks by one protocol (engine/train/hooks.py), in the
order `loop_hooks` gives: the step profiler, the finiteness guard (engine/train/finiteness.py), the
evaluation, the sampler, the checkpoints and the deferred metrics (engine/train/metrics.py). The
preemption watch is asked after every step whether to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging

from engine import config as config_lib
from engine import data, sharding
from engine.distributed import startup as distributed
from engine.runtime.progress import phase
from engine.hf import load as hf
from engine.workdir import checkpoint_tiers
from engine.workdir import lock as run_lock
from engine.workdir import summary as run_summary
from engine.runtime import compile_cache
from engine.workdir import shard_sets as run_shard_sets
from engine.workdir import tokenizer as run_tokenizer
from engine.workdir import run_dir as workdir_lib
from engine.assemble import Run, assemble
from engine.optimizer import schedule_end
from engine.parallel import expert_exchange
from engine.workdir.checkpoint import Checkpointer, restore_params
from engine.train import goodput as goodput_lib
from engine.train.finiteness import FinitenessGuard
from engine.train.watchdog import Watchdog
from engine.train.hooks import Checkpoints, Evaluation, Hook, close_all
from engine.train.metrics import DeferredMetrics, MetricsWriter, log_memory
from engine.train.preemption import PreemptionWatch
from engine.train.profiling import StepProfiler
from engine.train.samples import Sampler


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


def resume_step(run: Run, checkpointer: Checkpointer, local: Checkpointer | None,
                workdir) -> tuple[int | None, Checkpointer]:
  """The step of the newest intact checkpoint of either tier (the same on every process:
  engine/workdir/checkpoint_tiers.py) and the tier's Checkpointer, once this config is known to
  continue that run; None if there is none."""
  config = run.config
  start_step, tier = checkpoint_tiers.choose_resume(
      checkpointer, local, config.train.skip_damaged_checkpoints)
  if start_step is not None:
    workdir_lib.check_resumable(config, workdir)
    run_tokenizer.check_resumed(run.tokenizer, workdir)
    run_shard_sets.check_resumed(run.corpus, workdir)
    change = workdir_lib.layout_change(config, workdir)
    if change:
      logging.info('Resuming from step %d on another layout: %s.', start_step, change)
  return start_step, tier


def initial_state(run: Run, checkpointer: Checkpointer, train_iterator,
                  start_step: int | None) -> tuple:
  """(state, its step, init memory): the checkpoint of `start_step` (data position included),
  else (None) a fresh sharded state, with train.init_from's parameters if given."""
  config, abstract_state = run.config, run.setup.abstract_state()
  if start_step is not None:
    return checkpointer.restore(start_step, abstract_state, train_iterator), start_step, {}
  # Another run's parameters are checked against this model before anything compiles.
  init_from = config.train.init_from
  # The checkpoint holds the base model; parameters the model adds (adapters) start fresh.
  model = run.setup.model
  wanted = model.base_params(abstract_state['params'])
  if hf.path_of(init_from) is not None:
    params = hf.load_params(hf.path_of(init_from), wanted)
  else:
    params = restore_params(init_from, wanted) if init_from else None
  state, init_compiled = run.setup.init(config.seed)
  if params is not None:
    state['params'] = model.with_base(state['params'], params)
  return state, 0, {'init': log_memory('init', init_compiled)}


def loop_hooks(*, profiler: StepProfiler, guard: FinitenessGuard, evaluation: Hook,
               sampler: Hook, checkpoints: Hook, metrics: Hook, watchdog: Hook) -> list[Hook]:
  """The loop's hooks in the order they are called (engine/train/hooks.py), closed in reverse.

  The guard comes before the evaluation, the sampler and the checkpoints: a step that is not
  finite is never evaluated, sampled or saved; and before the metrics, which never log a step
  that stopped the run. The profiler comes first, so that its trace ends with the step; the
  metrics next, so that they close first: the final log line comes before the last save's wait;
  the watchdog last: it beats once the others are done, and stops before the final waits.
  """
  return [profiler, guard, evaluation, sampler, checkpoints, metrics, watchdog]


def global_batches(run: Run, train_iterator):
  """The train iterator's batches laid out on the mesh, one per step, read as the loop asks."""
  batch_sharding, size = run.setup.batch_sharding(), run.config.data.global_batch_size
  return (data.to_global(batch, batch_sharding, size) for batch in train_iterator)


@dataclasses.dataclass(kw_only=True)
class StepLoop:
  """The steps from the initial state to `num_steps` (or a preemption), each calling the hooks
  in list order (engine/train/hooks.py); once it ends, however it ends, every hook is closed,
  the last first."""
  num_steps: int
  batches: Iterator  # The global batch of each step.
  train_step: Callable  # Compiled: (state, batch) -> (state, metrics).
  preemption: PreemptionWatch
  pause: Callable[[], contextlib.AbstractContextManager]  # Time left out of the throughput.
  goodput: goodput_lib.Goodput  # Where the attempt's time goes.
  watchdog: Watchdog  # Also the last of `hooks`: its `waiting` wraps the waits for the devices.
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
    with self.goodput.timed('checkpoints'):  # Mostly the wait for the last save.
      close_all(self.hooks, None)

  def _steps(self, state, start_step: int) -> None:
    # Gloo's CPU collectives across processes hang with two steps in flight (seen with 2
    # processes x 4 devices, within the first 50 steps); there, the next step is dispatched
    # only once this one is done. Accelerators keep the overlap.
    lockstep = jax.process_count() > 1 and jax.default_backend() == 'cpu'
    self.goodput.loop_started()
    for step in range(start_step + 1, self.num_steps + 1):
      with self.goodput.timed('data'):
        tokens = next(self.batches)
      for hook in self.hooks:
        hook.before_dispatch(step, state)
      with self.watchdog.waiting():
        state, metrics = self.train_step(state, tokens)
        if lockstep:
          jax.block_until_ready(state)
      for hook in self.hooks:
        hook.after_dispatch(step, state, metrics)
      stopping = self.preemption.stop_after(step)
      if any(hook.wants_sync(step, stopping) for hook in self.hooks):
        # The step itself counts towards throughput; the eval, the sample and the save do not.
        with self.watchdog.waiting():
          jax.block_until_ready(state)
        with self.pause():
          for hook in self.hooks:
            with self.goodput.timed(hook.badput_cause):
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


def _log_start(run: Run) -> None:
  config, model = run.config, run.setup.model
  logging.info('Mesh %s, mode %s, rules %s; %s tokenizer, vocab %d (model %d), %s',
               dict(run.setup.mesh.shape), config.parallelism.mode, config.parallelism.rules,
               run.tokenizer.kind, run.tokenizer.vocab_size, model.vocab_size,
               data.describe(run.corpus))
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(run.setup.abstract_params))
  logging.info('Model %s: %.3fM parameters, %.3f MFLOP per token (training)', model.name,
               num_params / 1e6, model.flops_per_token(config.data.seq_len) / 1e6)
  if (model.experts and not model.experts.capacity_factor and
      run.setup.rules.mesh_axes('experts', activation=True)):
    how = ('blocks moved by ' + expert_exchange.exchange_kind(run.setup)
           if expert_exchange.exchanges_dropless(run.setup, config.parallelism.mode) else
           'a slot for every position (experts / k times the rows in use)')
    logging.info('Experts: the dropless dispatch over mesh.expert takes %s', how)


def _final_report(config, checkpointer: Checkpointer, preemption: PreemptionWatch,
                  result: TrainResult) -> None:
  if checkpointer.blocked_s:
    logging.info('Checkpoints: %d saved (%s), the loop waited median %.0f ms, max %.0f ms per '
                 'save', len(checkpointer.blocked_s),
                 'asynchronously' if config.train.async_checkpoints else 'synchronously',
                 1e3 * np.median(checkpointer.blocked_s), 1e3 * max(checkpointer.blocked_s))
  if preemption.signal_name and result.final_step < config.train.num_steps:
    logging.info('Stopped by %s after step %d of %d; its checkpoint is in %s. Rerun the same '
                 'command to resume.', preemption.signal_name, result.final_step,
                 config.train.num_steps, checkpointer.directory)
    result.preempted = True


def _already_finished(config, checkpointer: Checkpointer, workdir, step: int) -> TrainResult:
  """A rerun of a run whose checkpoint has reached train.num_steps: nothing is compiled or
  written (config.json, summary.json and the loss curve stay the finished run's), and the log
  says how to train further."""
  checkpointer.close()
  keep_end = ''
  if config.optim.decay_steps == -1 and config.optim.schedule != 'constant':
    # Its schedule ends at train.num_steps: a resume that moved the end would be refused.
    end = schedule_end(config.optim, config.train.num_steps)
    keep_end = (f' and --config.optim.decay_steps={end} (the {config.optim.schedule} schedule '
                f'keeps its end at step {end}; the rate stays at its end value after it)')
  logging.info('The run in %s is finished: its checkpoint is at step %d (train.num_steps=%d), so '
               'nothing was trained or written. To train further, rerun with '
               '--config.train.num_steps=M (M > %d)%s.', workdir, step, config.train.num_steps,
               step, keep_end)
  return TrainResult({}, {}, {}, step, {})


def train(config: ml_collections.ConfigDict, workdir: str,
          started: float | None = None) -> TrainResult:
  """Trains (or resumes) the experiment `config` in `workdir` (a local path or gs://...);
  `started`: when the command started (time.time(); default now), for the goodput."""
  started = time.time() if started is None else started
  run = assemble(config)
  sampler = Sampler(run)  # Its prompt is checked here, before anything is written.
  workdir = workdir_lib.prepare(workdir)  # After validation: a bad config leaves no workdir.
  # One run per workdir: a second is refused here, before it writes or compiles anything.
  with run_lock.hold(workdir), compile_cache.use(config.train.compile_cache_dir,
                                                 workdir) as compiled:
    return _train(run, workdir, sampler, compiled, started)


def _train(run: Run, workdir, sampler: Sampler, compiled: compile_cache.Counts,
           started: float) -> TrainResult:
  """The loop's phases, in a workdir this run holds."""
  config = run.config
  _log_start(run)
  train_iterator = data.train_iterator(run.corpus, config.data, config.seed)
  checkpointer, local = _checkpointers(run, workdir)
  start_step, tier = resume_step(run, checkpointer, local, workdir)
  if start_step is not None and start_step >= config.train.num_steps:
    if local is not None:
      local.close()
    return _already_finished(config, checkpointer, workdir, start_step)
  state, start_step, memory = initial_state(run, tier, train_iterator, start_step)
  logging.info('Parameters per device: %.2f MiB',
               sharding.bytes_per_device(state['params']) / 2**20)
  train_step, eval_step = compile_steps(run, memory)
  logging.info('Compilation: %s', compiled.describe())
  _record_start(run, workdir)
  num_steps = config.train.num_steps
  mesh = run.setup.mesh
  writer = _metrics_writer(run, workdir, start_step)
  peak_memory = run_summary.PeakMemory(memory['train_step'].get('peak_estimate_bytes'))
  result = TrainResult({}, {}, {}, start_step, memory)
  goodput = goodput_lib.Goodput(workdir, start_step, started)
  watchdog = Watchdog(workdir, config.train.hang_timeout_s, config.train.straggler_factor,
                      config.train.log_every, start_step)
  guard = FinitenessGuard(config.train.skip_nonfinite_steps, checkpointer, workdir)
  result.skipped_steps = guard.skipped
  writer.start_clock(start_step)
  preemption = PreemptionWatch()
  loop = StepLoop(
      num_steps=num_steps, batches=global_batches(run, train_iterator), train_step=train_step,
      preemption=preemption, pause=writer.pause, goodput=goodput, watchdog=watchdog,
      result=result,
      hooks=loop_hooks(
          profiler=StepProfiler(config.train.profile_steps, num_steps, start_step, workdir),
          guard=guard,
          evaluation=Evaluation(run, eval_step, guard=guard, writer=writer, result=result),
          sampler=sampler,
          checkpoints=Checkpoints(checkpointer, train_iterator, num_steps, local),
          metrics=DeferredMetrics(writer, result, config.train.log_every, num_steps, peak_memory,
                                  goodput),
          watchdog=watchdog))
  try:
    loop(state, start_step)
  finally:  # A failed attempt's time counts too.
    totals = goodput.update(result.final_step, final=True)
  _final_report(config, checkpointer, preemption, result)
  logging.info('Goodput: %s', goodput_lib.describe(totals))
  writer.close()
  result.summary = run_summary.write(
      workdir, status='preempted' if result.preempted else 'finished',
      final_step=result.final_step, num_steps=num_steps, peak_memory=peak_memory.read(),
      wall_s=time.time() - started, mode=config.parallelism.mode,
      mesh=run_summary.mesh_string(dict(mesh.shape)), model=run.setup.model.name,
      goodput=totals, compilation=compiled.record())
  writer.end_run(result.summary)
  return result


def _metrics_writer(run: Run, workdir, start_step: int) -> MetricsWriter:
  """The run's metrics writer: its loggers (train.loggers), tokens and FLOPs per step, and the
  devices' peak for MFU."""
  config = run.config
  return MetricsWriter(workdir, config.train.num_steps,
                       config.data.global_batch_size * config.data.seq_len,
                       run.setup.model.flops_per_token(config.data.seq_len), start_step,
                       run_summary.peak_flops_of_devices(
                           jax.devices()[0].device_kind, config.model.dtype, run.setup.mesh.size),
                       loggers=config_lib.logger_names(config.train.loggers), config=config)


def _record_start(run: Run, workdir) -> None:
  """config.json with its records, once the run is known to start. The workdir keeps the
  tokenizer, so that the finished run needs no file outside it."""
  workdir_lib.write_config(run.config, workdir,
                           tokenizer=run_tokenizer.save(run.tokenizer, workdir),
                           shard_sets=run_shard_sets.record(run.corpus),
                           layout=workdir_lib.layout(run.config))


def _checkpointers(run: Run, workdir) -> tuple[Checkpointer, Checkpointer | None]:
  """The workdir's Checkpointer and the local tier's (None without train.local_checkpoint_dir)."""
  train_config = run.config.train
  checkpointer = Checkpointer(workdir / 'checkpoints', train_config.checkpoint_every,
                              train_config.keep_checkpoints, train_config.async_checkpoints)
  return checkpointer, checkpoint_tiers.local_checkpointer(
      run.config, workdir, run.setup.abstract_state(), run.setup.mesh)
