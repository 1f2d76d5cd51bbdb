"""Training metrics: absl log lines, JSON lines (metrics.jsonl, always: summary.json and sweeps
read it), TensorBoard events (tensorboardX) and Weights & Biases (engine/train/wandb_logger.py) as
`train.loggers` chooses, and the loop's hook that feeds them without a host sync per step
(`DeferredMetrics`).

Only process 0 writes files; every process may call the writer. Throughput, MFU and the estimated
time left come from wall-clock time between log points, less the time spent paused (eval and
checkpoint saves, which the loop wraps in `pause()`). The workdir may be remote (gs://...): files go
through etils.epath, and TensorBoard events through tensorboardX's own writers.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

import jax
import numpy as np
from absl import logging
from etils import epath
from tensorboardX import SummaryWriter

from engine.train.hooks import Hook
from engine.train.wandb_logger import WandbLogger
from engine.workdir import run_dir as workdir_lib


class MetricsWriter:

  def __init__(self, workdir: str | epath.Path, num_steps: int, tokens_per_step: int,
               flops_per_token: float = 0.0, start_step: int = 0,
               peak_flops: float | None = None, clock=time.perf_counter,
               loggers: tuple[str, ...] = ('tensorboard', 'jsonl'), config=None):
    """`start_step`: the step the run starts from (a resumed checkpoint's). Anything logged
    after it by an earlier attempt is dropped, since those steps are about to be redone: the
    lines of metrics.jsonl, and TensorBoard's events (its `purge_step`). `peak_flops`: the peak
    FLOP/s of all the run's devices together, for MFU (None: unknown, no MFU). `loggers`:
    train.loggers' names; `config`: the experiment's, for W&B."""
    self.is_writer = jax.process_index() == 0
    self.num_steps = num_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token  # The model's training FLOPs, for achieved FLOP/s.
    self.peak_flops = peak_flops
    self._clock = clock
    self._last_time = None
    self._last_step = None
    self._paused_s = 0.0  # Time inside pause() since the last log point.
    self.steps_per_s: list[float] = []  # One entry per log interval, for the closing summary.
    self.tensorboard = self.wandb = None
    if self.is_writer:
      workdir = workdir_lib.resolve(workdir)
      if 'tensorboard' in loggers:
        self.tensorboard = SummaryWriter(str(workdir / 'tensorboard'), purge_step=start_step + 1)
      self.jsonl = JsonLines(workdir / 'metrics.jsonl', start_step)
      if 'wandb' in loggers:
        self.wandb = WandbLogger(workdir, config.train, config.to_dict())

  def start_clock(self, step: int) -> None:
    """Marks the start of timed steps (call after compilation, so it is not counted)."""
    self._last_time, self._last_step, self._paused_s = self._clock(), step, 0.0

  @contextlib.contextmanager
  def pause(self):
    """Time spent inside (eval, checkpoint saves) is left out of the throughput."""
    start = self._clock()
    try:
      yield
    finally:
      self._paused_s += self._clock() - start

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.is_writer:
      return
    if self.tensorboard is not None:
      for name, value in scalars.items():
        self.tensorboard.add_scalar(name, value, step)
    self.jsonl.write({'step': step, **scalars})
    if self.wandb is not None:
      self.wandb.write(step, scalars)

  def log_train(self, step: int, loss: float, learning_rate: float, grad_norm: float,
                extra: dict[str, float] | None = None) -> None:
    """Logs one training point (`loss`: the mean over the steps since the previous one) with
    throughput since the previous one, pauses left out; `extra`: more scalars to write."""
    now = self._clock()
    scalars = {'train/loss': loss, 'train/learning_rate': learning_rate,
               'train/grad_norm': grad_norm, **(extra or {})}
    eta = ''
    busy_s = None if self._last_time is None else now - self._last_time - self._paused_s
    if busy_s is not None and step > self._last_step and busy_s > 0:
      steps_per_s = (step - self._last_step) / busy_s
      scalars['train/steps_per_s'] = steps_per_s
      self.steps_per_s.append(steps_per_s)
      scalars['train/tokens_per_s'] = steps_per_s * self.tokens_per_step
      scalars['train/model_flops_per_s'] = scalars['train/tokens_per_s'] * self.flops_per_token
      if self.peak_flops:
        scalars['train/mfu'] = scalars['train/model_flops_per_s'] / self.peak_flops
      time_left = _duration((self.num_steps - step) / steps_per_s)
      mfu = f' | mfu {scalars["train/mfu"]:.1%}' if 'train/mfu' in scalars else ''
      eta = f' | {scalars["train/tokens_per_s"]:,.0f} tok/s{mfu} | eta {time_left}'
    self._last_time, self._last_step, self._paused_s = now, step, 0.0
    logging.info('step %d/%d | loss %.4f | lr %.2e | grad norm %.3f%s%s', step, self.num_steps,
                 loss, learning_rate, grad_norm, router_health(scalars), eta)
    self.write(step, scalars)

  def log_eval(self, step: int, loss: float) -> None:
    perplexity = perplexity_of(loss)
    logging.info('step %d/%d | eval loss %.4f | perplexity %.2f', step, self.num_steps, loss,
                 perplexity)
    self.write(step, {'eval/loss': loss, 'eval/perplexity': perplexity})

  def close(self) -> None:
    if self.steps_per_s:
      median = float(np.median(self.steps_per_s))
      tokens_per_s = median * self.tokens_per_step
      logging.info(f'Throughput: median {median:.2f} steps/s, {tokens_per_s:,.0f} tokens/s, '
                   f'{tokens_per_s * self.flops_per_token / 1e9:,.2f} model GFLOP/s over '
                   f'{len(self.steps_per_s)} log intervals')
    if self.is_writer:
      if self.tensorboard is not None:
        self.tensorboard.close()
      self.jsonl.close()

  def end_run(self, summary: dict | None) -> None:
    """Ends the W&B run (after close and summary.json), `summary` its summary."""
    if self.wandb is not None:
      self.wandb.close(summary)


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


class JsonLines:
  """metrics.jsonl: one JSON object per line, written as they come.

  Lines of steps after `start_step` (logged by an earlier attempt of a resumed run) are dropped
  first, atomically, since those steps run again. Local files are appended to; object stores
  cannot append, so there the file is rewritten whole, at most every `remote_every_s` seconds
  and on close."""

  def __init__(self, path: epath.Path, start_step: int, remote_every_s: float = 60.0):
    self.path = path
    self.remote = workdir_lib.is_remote(path)
    self.remote_every_s = remote_every_s
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    self.lines = [line for line in lines if line.strip() and json.loads(line)['step'] <= start_step]
    if len(self.lines) < len(lines):
      workdir_lib.write_text_atomically(path, ''.join(self.lines))
      logging.info('Dropped %d lines of %s logged after step %d: those steps run again.',
                   len(lines) - len(self.lines), path, start_step)
    self._file = None if self.remote else path.open('a')
    self._written_at = time.monotonic()

  def write(self, record: dict) -> None:
    line = json.dumps(record) + '\n'
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
      return
    self.lines.append(line)
    if time.monotonic() - self._written_at > self.remote_every_s:
      self._rewrite()

  def _rewrite(self) -> None:
    self.path.write_text(''.join(self.lines))
    self._written_at = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    else:
      self._rewrite()


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
