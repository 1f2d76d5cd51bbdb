"""The training loop, in four phases: the initial state (fresh, another run's parameters, or the
workdir's checkpoint), the compiled steps, the step loop, the final report.

Everything before the first phase (validation, data, the model laid out on the mesh) is
engine.assemble's; the loop's hooks are small objects: the finiteness guard
(engine/train/finiteness.py), the metrics writer, the checkpointer, the evaluator and the preemption
watch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time

import jax
import ml_collections
import numpy as np
from absl import logging

from engine import data, sharding
from engine.distributed import startup as distributed
from engine.hf import load as hf
from engine.workdir import lock as run_lock
from engine.workdir import summary as run_summary
from engine.workdir import tokenizer as run_tokenizer
from engine.workdir import run_dir as workdir_lib
from engine.assemble import Run, assemble
from engine.workdir.checkpoint import Checkpointer, restore_params
from engine.train.finiteness import FinitenessGuard
from engine.train.metrics import MetricsWriter, log_memory
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


def initial_state(run: Run, checkpointer: Checkpointer, train_iterator, workdir) -> tuple:
  """(state, its step, init memory): the workdir's newest intact checkpoint (data position
  included), else a fresh sharded state, with train.init_from's parameters if given."""
  config, abstract_state = run.config, run.setup.abstract_state()
  # Every process resumes from the same step, whose files process 0 has checked.
  start_step = checkpointer.choose_resume_step(config.train.skip_damaged_checkpoints)
  if start_step is not None:
    workdir_lib.check_resumable(config, workdir)
    run_tokenizer.check_resumed(run.tokenizer, workdir)
    return checkpointer.restore(start_step, abstract_state, train_iterator), start_step, {}
  # Another run's parameters are checked against this model before anything compiles.
  init_from = config.train.init_from
  if hf.path_of(init_from) is not None:
    params = hf.load_params(hf.path_of(init_from), abstract_state['params'])
  else:
    params = restore_params(init_from, abstract_state['params']) if init_from else None
  state, init_compiled = run.setup.init(config.seed)
  if params is not None:
    state['params'] = params
  return state, 0, {'init': log_memory('init', init_compiled)}


class Evaluator:
  """The eval step on the same fixed held-out batches every time, so losses compare."""

  def __init__(self, run: Run, eval_step):
    config = run.config
    self.eval_step = eval_step
    self.batches = [
        data.to_global(b, run.setup.batch_sharding(), config.data.global_batch_size)
        for b in data.eval_batches(run.corpus, config.data, config.seed,
                                   config.train.eval_batches)]

  def __call__(self, params) -> float:
    return float(np.mean([self.eval_step(params, b) for b in self.batches]))


class DeferredMetrics:
  """Logs every log_every-th step's metrics, fetched once the next step is dispatched, with the
  mean loss of the steps since the previous log point (their losses stay on the device until
  then: no host sync per step)."""

  def __init__(self, writer: MetricsWriter, result: TrainResult, log_every: int,
               num_steps: int, peak_memory: run_summary.PeakMemory):
    self.writer, self.result = writer, result
    self.log_every, self.num_steps = log_every, num_steps
    self.peak_memory = peak_memory
    self._pending = None
    self._losses = []  # Device scalars of the steps since the last log point.

  def after_dispatch(self, step: int, metrics) -> None:
    self.flush()
    self._losses.append(metrics['loss'])
    if step % self.log_every == 0 or step == self.num_steps:
      self._pending = (step, metrics, self._losses)
      self._losses = []

  def flush(self) -> None:
    if self._pending is None:
      return
    step, metrics, losses = self._pending
    self._pending = None
    metrics, losses = jax.device_get((metrics, losses))
    loss, grad_norm = float(metrics['loss']), float(metrics['grad_norm'])
    finite = [float(l) for l in losses if np.isfinite(l)]  # Skipped steps' are not.
    mean_loss = float(np.mean(finite)) if finite else loss
    # A mixture of experts' router health (steps.model_metrics): this step's, not a mean.
    extra = {name: float(value) for name, value in metrics.items() if name.startswith('moe/')}
    peak_bytes, _ = self.peak_memory.read()
    if peak_bytes is not None:
      extra['train/peak_memory_bytes'] = peak_bytes
    self.writer.log_train(step, mean_loss, float(metrics['learning_rate']), grad_norm, extra)
    self.result.train_losses[step] = loss
    self.result.train_interval_losses[step] = mean_loss
    self.result.train_grad_norms[step] = grad_norm


@dataclasses.dataclass
class StepLoop:
  """The steps from the initial state to train.num_steps (or a preemption), and the hooks
  each step calls."""
  run: Run
  train_step: object  # Compiled.
  train_iterator: object
  evaluate: Evaluator
  checkpointer: Checkpointer
  guard: FinitenessGuard
  metrics: DeferredMetrics
  preemption: PreemptionWatch
  result: TrainResult
  profiler: StepProfiler
  sampler: Sampler  # train.sample_every's samples.

  def __call__(self, state, start_step: int) -> None:
    config = self.run.config
    num_steps, batch = config.train.num_steps, config.data.global_batch_size
    batch_sharding = self.run.setup.batch_sharding()
    # Gloo's CPU collectives across processes hang with two steps in flight (seen with 2
    # processes x 4 devices, within the first 50 steps); there, the next step is dispatched
    # only once this one is done. Accelerators keep the overlap.
    lockstep = jax.process_count() > 1 and jax.default_backend() == 'cpu'
    for step in range(start_step + 1, num_steps + 1):
      tokens = data.to_global(next(self.train_iterator), batch_sharding, batch)
      self.profiler.before(step, state)
      state, metrics = self.train_step(state, tokens)
      self.profiler.after(step, state, metrics)
      if lockstep:
        jax.block_until_ready(state)
      self.guard.after_dispatch(step, metrics)
      self.metrics.after_dispatch(step, metrics)
      stop = self.preemption.stop_after(step)
      final = step == num_steps or stop
      evaluate = (step % config.train.eval_every == 0 or step == num_steps) and not stop
      sample = self.sampler.due(step) and not stop
      if evaluate or sample or self.checkpointer.is_due(step, force=final):
        # Nothing not finite is evaluated, sampled or checkpointed.
        self.guard.check(step, metrics)
        # The step itself counts towards throughput; the eval, the sample and the save do not.
        jax.block_until_ready(state)
        with self.metrics.writer.pause():
          if evaluate:
            self._evaluate(step, state['params'])
          if sample:
            self.sampler(step, state['params'])
          self.checkpointer.save(step, state, self.train_iterator, force=final)
      self.result.final_step = step
      if stop:
        break
    self.metrics.flush()

  def _evaluate(self, step: int, params) -> None:
    eval_loss = self.evaluate(params)
    self.guard.stop_if_not_finite(step, {'eval loss': eval_loss})
    self.metrics.writer.log_eval(step, eval_loss)
    self.result.eval_losses[step] = eval_loss


def compile_steps(run: Run, memory: dict) -> tuple:
  """The train and eval steps compiled for the run's abstract state and batch (memory stats
  logged and kept)."""
  train_step = run.compile_train_step()
  memory['train_step'] = log_memory('train step', train_step)
  return train_step, run.compile_eval_step()


def _log_start(run: Run) -> None:
  config, model = run.config, run.setup.model
  logging.info('Mesh %s, mode %s, rules %s; %s tokenizer, vocab %d (model %d), %s',
               dict(run.setup.mesh.shape), config.parallelism.mode, config.parallelism.rules,
               run.tokenizer.kind, run.tokenizer.vocab_size, model.vocab_size,
               data.describe(run.corpus))
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(run.setup.abstract_params))
  logging.info('Model %s: %.3fM parameters, %.3f MFLOP per token (training)', model.name,
               num_params / 1e6, model.flops_per_token(config.data.seq_len) / 1e6)


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


def _close_quietly(checkpointer: Checkpointer) -> None:
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


def train(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Trains (or resumes) the experiment `config` in `workdir` (a local path or gs://...)."""
  run = assemble(config)
  sampler = Sampler(run)  # Its prompt is checked here, before anything is written.
  workdir = workdir_lib.prepare(workdir)  # After validation: a bad config leaves no workdir.
  # One run per workdir: a second is refused here, before it writes or compiles anything.
  with run_lock.hold(workdir):
    return _train(run, workdir, sampler)


def _train(run: Run, workdir, sampler: Sampler) -> TrainResult:
  """The loop's phases, in a workdir this run holds."""
  config, started = run.config, time.perf_counter()
  _log_start(run)
  train_iterator = data.train_iterator(run.corpus, config.data, config.seed)
  checkpointer = Checkpointer(workdir / 'checkpoints', config.train.checkpoint_every,
                              config.train.keep_checkpoints, config.train.async_checkpoints)
  state, start_step, memory = initial_state(run, checkpointer, train_iterator, workdir)
  logging.info('Parameters per device: %.2f MiB',
               sharding.bytes_per_device(state['params']) / 2**20)
  train_step, eval_step = compile_steps(run, memory)
  # The workdir keeps the tokenizer, so that the finished run needs no file outside it.
  workdir_lib.write_config(config, workdir, run_tokenizer.save(run.tokenizer, workdir))
  num_steps = config.train.num_steps
  mesh = run.setup.mesh
  writer = MetricsWriter(workdir, num_steps, config.data.global_batch_size * config.data.seq_len,
                         run.setup.model.flops_per_token(config.data.seq_len), start_step,
                         run_summary.peak_flops_of_devices(
                             jax.devices()[0].device_kind, config.model.dtype, mesh.size))
  peak_memory = run_summary.PeakMemory(memory['train_step'].get('peak_estimate_bytes'))
  result = TrainResult({}, {}, {}, start_step, memory)
  guard = FinitenessGuard(config.train.skip_nonfinite_steps, checkpointer, workdir)
  result.skipped_steps = guard.skipped
  if start_step >= num_steps:
    logging.info('The checkpoint in %s is at step %d, train.num_steps=%d: nothing to train.',
                 workdir, start_step, num_steps)
  writer.start_clock(start_step)
  preemption = PreemptionWatch()
  loop = StepLoop(run, train_step, train_iterator, Evaluator(run, eval_step), checkpointer,
                  guard,
                  DeferredMetrics(writer, result, config.train.log_every, num_steps, peak_memory),
                  preemption, result,
                  StepProfiler(config.train.profile_steps, num_steps, start_step, workdir),
                  sampler)
  try:
    loop(state, start_step)
  except jax.errors.JaxRuntimeError:
    distributed.await_failure_report()
    raise
  except BaseException:
    _close_quietly(checkpointer)
    raise
  finally:
    with contextlib.suppress(Exception):  # The error that stopped the run is the one reported.
      loop.profiler.stop()  # A run stopped inside the range keeps its partial trace.
    preemption.close()
  checkpointer.close()
  _final_report(config, checkpointer, preemption, result)
  writer.close()
  result.summary = run_summary.write(
      workdir, status='preempted' if result.preempted else 'finished',
      final_step=result.final_step, num_steps=num_steps, peak_memory=peak_memory.read(),
      wall_s=time.perf_counter() - started, mode=config.parallelism.mode,
      mesh=run_summary.mesh_string(dict(mesh.shape)), model=run.setup.model.name)
  return result
