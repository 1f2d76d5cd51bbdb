"""Training metrics: the scalars of each log point, computed once and handed to the loggers
`train.loggers` chooses (engine/loggers/: metrics.jsonl always, TensorBoard, Weights & Biases),
the log's line, and the loop's hook that feeds them without a host sync per step
(`DeferredMetrics`).

Only process 0 writes; every process may call the writer. Throughput, MFU and the estimated time
left come from the loop's clock (engine/train/clock.py): the time between log points less the
time at sync points (evaluations, checkpoint saves, samples).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from absl import logging
from etils import epath

from engine import loggers
from engine.train.clock import LoopClock
from engine.train.hooks import Hook
from engine.workdir import run_dir as workdir_lib


class MetricsWriter:
  """The run's scalars, computed and handed to its loggers (engine/loggers/)."""

  def __init__(self, workdir: str | epath.Path, num_steps: int, tokens_per_step: int,
               flops_per_token: float = 0.0, start_step: int = 0,
               peak_flops: float | None = None, clock: LoopClock | None = None, config=None):
    """`start_step`: the step the run starts from (a resumed checkpoint's): each logger drops
    what an earlier attempt logged after it, where it can, since those steps run again.
    `peak_flops`: the peak FLOP/s of all the run's devices together, for MFU (None: unknown, no
    MFU). `clock`: the loop's (throughput is read off it); `config`: the experiment's, whose
    train.loggers choose the loggers (None: metrics.jsonl alone)."""
    self.is_writer = jax.process_index() == 0
    self.num_steps = num_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token  # The model's training FLOPs, for achieved FLOP/s.
    self.peak_flops = peak_flops
    self.clock = clock or LoopClock()
    # The last log point: (the clock's time, its seconds outside the steps, the step).
    self._last = None
    self._start_step = start_step
    self.steps_per_s: list[float] = []  # One entry per log interval, for the closing summary.
    self.loggers = []
    if self.is_writer:
      workdir = workdir_lib.resolve(workdir)
      self.loggers = (loggers.open_loggers(config, workdir, start_step) if config is not None
                      else [loggers.LOGGERS[loggers.RECORD](workdir, start_step, None)])

  def write(self, step: int, scalars: dict[str, float]) -> None:
    for logger in self.loggers:
      logger.write(step, scalars)

  def log_train(self, step: int, loss: float, learning_rate: float, grad_norm: float,
                extra: dict[str, float] | None = None) -> None:
    """Logs one training point (`loss`: the mean over the steps since the previous one) with
    throughput since the previous one (or the loop's start), the sync phases left out;
    `extra`: more scalars to write."""
    now, outside = self.clock.now(), self.clock.outside_steps()
    scalars = {'train/loss': loss, 'train/learning_rate': learning_rate,
               'train/grad_norm': grad_norm, **(extra or {})}
    eta = ''
    last = self._last or (self.clock.started, 0.0, self._start_step)
    busy_s = None if last[0] is None else now - last[0] - (outside - last[1])
    if busy_s is not None and step > last[2] and busy_s > 0:
      steps_per_s = (step - last[2]) / busy_s
      scalars['train/steps_per_s'] = steps_per_s
      self.steps_per_s.append(steps_per_s)
      scalars['train/tokens_per_s'] = steps_per_s * self.tokens_per_step
      scalars['train/model_flops_per_s'] = scalars['train/tokens_per_s'] * self.flops_per_token
      if self.peak_flops:
        scalars['train/mfu'] = scalars['train/model_flops_per_s'] / self.peak_flops
      time_left = _duration((self.num_steps - step) / steps_per_s)
      mfu = f' | mfu {scalars["train/mfu"]:.1%}' if 'train/mfu' in scalars else ''
      eta = f' | {scalars["train/tokens_per_s"]:,.0f} tok/s{mfu} | eta {time_left}'
    self._last = (now, outside, step)
    logging.info('step %d/%d | loss %.4f | lr %.2e | grad norm %.3f%s%s', step, self.num_steps,
                 loss, learning_rate, grad_norm, router_health(scalars), eta)
    self.write(step, scalars)

  def log_eval(self, step: int, loss: float) -> None:
    perplexity = perplexity_of(loss)
    logging.info('step %d/%d | eval loss %.4f | perplexity %.2f', step, self.num_steps, loss,
                 perplexity)
    self.write(step, {'eval/loss': loss, 'eval/perplexity': perplexity})

  def close(self) -> None:
    """The run's logging is over (before summary.json, which reads metrics.jsonl back)."""
    if self.steps_per_s:
      median = float(np.median(self.steps_per_s))
      tokens_per_s = median * self.tokens_per_step
      logging.info(f'Throughput: median {median:.2f} steps/s, {tokens_per_s:,.0f} tokens/s, '
                   f'{tokens_per_s * self.flops_per_token / 1e9:,.2f} model GFLOP/s over '
                   f'{len(self.steps_per_s)} log intervals')
    for logger in self.loggers:
      logger.close()

  def end_run(self, summary: dict | None) -> None:
    """Hands every logger summary.json's contents, once it is written."""
    for logger in self.loggers:
      logger.end_run(summary)


class DeferredMetrics(Hook):
  """Logs every log_every-th step's metrics, fetched once the next step is dispatched, with the
  mean loss of the steps since the previous log point (their losses stay on the device until
  then: no host sync per step). `result` (the loop's TrainResult) keeps what was logged;
  `peak_memory.read()` gives the peak bytes so far (or None); `goodput` (the attempt's Goodput,
  engine/train/goodput.py) is recorded at each log point and its share logged with it."""

  def __init__(self, writer: MetricsWriter, result, log_every: int, num_steps: int,
               peak_memory, goodput=None):
    self.writer, self.result, self.goodput = writer, result, goodput
    self.log_every, self.num_steps = log_every, num_steps
    self.peak_memory = peak_memory
    self._pending = None
    self._losses = []  # Device scalars of the steps since the last log point.

  def after_dispatch(self, step: int, state, metrics) -> None:
    del state
    self.flush()
    self._losses.append(metrics['loss'])
    if step % self.log_every == 0 or step == self.num_steps:
      self._pending = (step, metrics, self._losses)
      self._losses = []

  def close(self, error: BaseException | None) -> None:
    """Logs the pending point once the loop has finished; after an error it is dropped (it may
    be the step that stopped the run)."""
    if error is None:
      self.flush()

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
    if self.goodput is not None:
      totals = self.goodput.update(step)
      if totals['goodput'] is not None:
        extra['goodput/share'] = totals['goodput']
        extra.update({f'badput/{cause}_s': s for cause, s in totals['badput_s'].items()})
    self.writer.log_train(step, mean_loss, float(metrics['learning_rate']), grad_norm, extra)
    self.result.train_losses[step] = loss
    self.result.train_interval_losses[step] = mean_loss
    self.result.train_grad_norms[step] = grad_norm


def router_health(scalars: dict[str, float]) -> str:
  """The log line's part for a mixture of experts (engine.parallel.steps.model_metrics): the
  least and most loaded expert and the coefficient of variation of the load (as multiples of
  the mean load: all 1.0 when balanced), the assignments dropped, and under aux_free balancing
  the router bias' range; '' for a dense model."""
  if 'moe/load_min' not in scalars:
    return ''
  bias = (f' bias {scalars["moe/bias_min"]:+.3f}..{scalars["moe/bias_max"]:+.3f}'
          if 'moe/bias_min' in scalars else '')
  return (f' | load {scalars["moe/load_min"]:.2f}-{scalars["moe/load_max"]:.2f} '
          f'cv {scalars["moe/load_cv"]:.2f} dropped {scalars["moe/dropped_fraction"]:.1%}{bias}')


def perplexity_of(loss: float) -> float:
  """exp(loss), infinite where it would overflow a float."""
  return math.inf if loss > 700 else math.exp(loss)


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(int(seconds), 60)
  return f'{minutes}m{seconds:02d}s'


def log_memory(name: str, compiled) -> dict[str, int]:
  """Logs and returns the per-device memory of a compiled function."""
  stats = compiled.memory_analysis()
  fields = ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes',
            'alias_size_in_bytes', 'generated_code_size_in_bytes', 'host_temp_size_in_bytes',
            'host_argument_size_in_bytes')
  memory = {f: int(getattr(stats, f, 0) or 0) for f in fields} if stats else {}
  if memory:
    peak = (memory['argument_size_in_bytes'] + memory['output_size_in_bytes'] +
            memory['temp_size_in_bytes'] - memory['alias_size_in_bytes'])
    memory['peak_estimate_bytes'] = peak
    # Offloaded activations (model.remat=offload_*) and optimizer state (offload_optimizer).
    host = memory['host_temp_size_in_bytes'] + memory['host_argument_size_in_bytes']
    logging.info('%s per-device memory: arguments %s, outputs %s, temporaries %s, aliased %s, '
                 'peak about %s%s', name, *(_mib(memory[f]) for f in fields[:4]), _mib(peak),
                 f'; host memory {_mib(host)}' if host else '')
  return memory


def _mib(n: int) -> str:
  return f'{n / 2**20:.2f} MiB'
