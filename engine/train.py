"""The training loop: validate -> mesh -> data -> init or restore -> steps -> eval -> checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import ml_collections
import numpy as np
from absl import logging

from engine import config as config_lib
from engine import data, distributed, hf, models, parallel, sharding, validation
from engine import workdir as workdir_lib
from engine.checkpoint import Checkpointer, restore_params
from engine.mesh import make_mesh
from engine.metrics import MetricsWriter, log_memory
from engine.optimizer import make_optimizer
from engine.preemption import PreemptionWatch
from engine.state import StepOptions, TrainSetup, make_setup


@dataclasses.dataclass
class TrainResult:
  """What a run reports back: the logged steps' train losses and gradient norms (before
  clipping), eval losses, the last step, compiled memory."""
  train_losses: dict[int, float]
  train_grad_norms: dict[int, float]
  eval_losses: dict[int, float]
  final_step: int
  memory: dict[str, dict[str, int]]
  preempted: bool = False  # Stopped early by SIGTERM / SIGINT, with a checkpoint.
  # Steps whose loss or gradient norm was not finite and whose update was not applied
  # (train.skip_nonfinite_steps > 0).
  skipped_steps: list[int] = dataclasses.field(default_factory=list)


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


def resolve_vocab_size(model_config, tokenizer_vocab: int) -> int:
  """The model's vocabulary: the config's, or the tokenizer's rounded up to `vocab_multiple`."""
  if model_config.vocab_size == -1:
    return math.ceil(tokenizer_vocab / model_config.vocab_multiple) * model_config.vocab_multiple
  if model_config.vocab_size < tokenizer_vocab:
    raise config_lib.ConfigError(
        f'model.vocab_size={model_config.vocab_size} is smaller than the tokenizer\'s '
        f'{tokenizer_vocab} tokens; raise it or set it to -1.')
  return model_config.vocab_size


def build_setup(config: ml_collections.ConfigDict, tokenizer_vocab: int,
                devices=None) -> TrainSetup:
  """Mesh, rules, model and optimizer of a validated config: everything but the data. The mesh
  spans `devices` (default: this run's; engine.plan passes a TPU topology's)."""
  mesh = make_mesh(config.mesh, devices)
  rules = sharding.rules_for(config.parallelism.rules, dict(mesh.shape))
  model = dataclasses.replace(
      models.build(config.model, resolve_vocab_size(config.model, tokenizer_vocab)),
      layer_groups=config.train.pipeline_repeats)
  options = StepOptions(compute_dtype=config.model.dtype, remat=config.model.remat,
                        microbatches=config.train.microbatches,
                        grad_reduce_dtype=config.parallelism.grad_reduce_dtype,
                        skip_nonfinite=config.train.skip_nonfinite_steps > 0)
  train_setup = make_setup(model, make_optimizer(config.optim, config.train.num_steps), mesh,
                           rules, options)
  validation.check_parameter_splits(train_setup.parameters(), dict(mesh.shape))
  if mesh.shape['context'] > 1 and not model.context_parallel:
    raise config_lib.ConfigError(
        f'mesh.context={mesh.shape["context"]}: model {model.name!r} does not support context '
        'parallelism (its ModelSpec has context_parallel=False); set mesh.context=1.')
  return train_setup


def setup(config: ml_collections.ConfigDict) -> tuple[data.Corpus, TrainSetup]:
  """Validates the config (before anything compiles), reads the data, lays out model and
  optimizer."""
  hf.apply_model_config(config)  # train.init_from=hf:PATH: the model is PATH's.
  validation.validate(config, jax.device_count(), jax.process_count(),
                      validation.count_slices(jax.devices()))
  corpus = data.load_corpus(config.data, config.seed)
  return corpus, build_setup(config, corpus.tokenizer.vocab_size)


def train(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Trains (or resumes) the experiment `config` in `workdir` (a local path or gs://...)."""
  corpus, train_setup = setup(config)
  workdir = workdir_lib.prepare(workdir)  # After validation: a bad config leaves no workdir.
  model = train_setup.model
  logging.info('Mesh %s, mode %s, rules %s; %s tokenizer, vocab %d (model %d), %s',
               dict(train_setup.mesh.shape), config.parallelism.mode, config.parallelism.rules,
               corpus.tokenizer.kind, corpus.tokenizer.vocab_size, model.vocab_size,
               data.describe(corpus))
  num_steps = config.train.num_steps
  steps = parallel.STEP_BUILDERS[config.parallelism.mode](train_setup)
  batch_sharding = train_setup.batch_sharding()
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(train_setup.abstract_params))
  flops_per_token = model.flops_per_token(config.data.seq_len)
  logging.info('Model %s: %.3fM parameters, %.3f MFLOP per token (training)', model.name,
               num_params / 1e6, flops_per_token / 1e6)

  train_iterator = data.train_iterator(corpus, config.data, config.seed)
  checkpointer = Checkpointer(workdir / 'checkpoints', config.train.checkpoint_every,
                              config.train.keep_checkpoints, config.train.async_checkpoints)
  memory = {}
  abstract_state = train_setup.abstract_state()
  # Every process resumes from the same step, whose files process 0 has checked.
  start_step = checkpointer.choose_resume_step(config.train.skip_damaged_checkpoints)
  if start_step is None:
    # Another run's parameters are checked against this model before anything compiles.
    if hf.path_of(config.train.init_from) is not None:
      params = hf.load_params(hf.path_of(config.train.init_from), abstract_state['params'])
    else:
      params = (restore_params(config.train.init_from, abstract_state['params'])
                if config.train.init_from else None)
    state, init_compiled = train_setup.init(config.seed)
    memory['init'] = log_memory('init', init_compiled)
    start_step = 0
    if params is not None:
      state['params'] = params
  else:
    workdir_lib.check_resumable(config, workdir)
    state = checkpointer.restore(start_step, abstract_state, train_iterator)
  logging.info('Parameters per device: %.2f MiB',
               sharding.bytes_per_device(state['params']) / 2**20)

  global_batch = config.data.global_batch_size
  abstract_batch = train_setup.abstract_batch(global_batch, config.data.seq_len)
  train_step = steps.train.lower(abstract_state, abstract_batch).compile()
  memory['train_step'] = log_memory('train step', train_step)
  eval_step = steps.eval.lower(abstract_state['params'], abstract_batch).compile()
  eval_data = [data.to_global(b, batch_sharding, global_batch)
               for b in data.eval_batches(corpus, config.data, config.seed,
                                          config.train.eval_batches)]

  workdir_lib.write_config(config, workdir)
  writer = MetricsWriter(workdir, num_steps, global_batch * config.data.seq_len,
                         flops_per_token, start_step)
  result = TrainResult({}, {}, {}, start_step, memory)
  pending = None  # Metrics of the last step to log, fetched once the next step is dispatched.

  def stop_if_not_finite(step: int, values: dict[str, float]) -> None:
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
      last_saved = checkpointer.latest_step()
      checkpointer.close()  # Saves in flight are of earlier, finite steps: let them finish.
      raise NonFiniteError(step, bad, last_saved, workdir)

  skip_limit = config.train.skip_nonfinite_steps
  consecutive_skips = 0

  def check(step, metrics) -> None:
    """Stops at a step whose loss or gradient norm is not finite (two scalars fetched), or
    counts it if such steps are skipped, stopping after more than `skip_limit` in a row."""
    nonlocal consecutive_skips
    loss, grad_norm = jax.device_get((metrics['loss'], metrics['grad_norm']))
    values = {'train loss': float(loss), 'gradient norm': float(grad_norm)}
    if all(math.isfinite(v) for v in values.values()):
      consecutive_skips = 0
      return
    consecutive_skips += 1
    if consecutive_skips <= skip_limit:
      result.skipped_steps.append(step)
      logging.warning('Step %d: %s; skipped (its update was not applied): %d in a row, %d in '
                      'all; train.skip_nonfinite_steps=%d in a row are allowed.', step,
                      ', '.join(f'{k} {v}' for k, v in values.items()), consecutive_skips,
                      len(result.skipped_steps), skip_limit)
      return
    stop_if_not_finite(step, values)

  def flush(pending):
    step, metrics = pending
    metrics = jax.device_get(metrics)
    loss = float(metrics['loss'])
    grad_norm = float(metrics['grad_norm'])
    writer.log_train(step, loss, float(metrics['learning_rate']), grad_norm)
    result.train_losses[step] = loss
    result.train_grad_norms[step] = grad_norm

  if start_step >= num_steps:
    logging.info('The checkpoint in %s is at step %d, train.num_steps=%d: nothing to train.',
                 workdir, start_step, num_steps)
  # Gloo's CPU collectives across processes hang with two steps in flight (seen with 2
  # processes x 4 devices, within the first 50 steps); there, the next step is dispatched only
  # once this one is done. Accelerators keep the overlap.
  lockstep = jax.process_count() > 1 and jax.default_backend() == 'cpu'
  writer.start_clock(start_step)
  unchecked = None  # The previous step, checked once this one is dispatched (no device stall).
  preemption = PreemptionWatch()
  try:
    for step in range(start_step + 1, num_steps + 1):
      batch = data.to_global(next(train_iterator), batch_sharding, global_batch)
      state, metrics = train_step(state, batch)
      if lockstep:
        jax.block_until_ready(state)
      if unchecked is not None:
        check(*unchecked)
      unchecked = (step, metrics)
      if pending is not None:
        flush(pending)
        pending = None
      if step % config.train.log_every == 0 or step == num_steps:
        pending = (step, metrics)
      stop = preemption.stop_after(step)
      final = step == num_steps or stop
      evaluate = (step % config.train.eval_every == 0 or step == num_steps) and not stop
      if evaluate or checkpointer.is_due(step, force=final):
        check(step, metrics)  # A step that is not finite is never evaluated or checkpointed.
        unchecked = None
      if evaluate:
        eval_loss = float(np.mean([eval_step(state['params'], b) for b in eval_data]))
        stop_if_not_finite(step, {'eval loss': eval_loss})
        writer.log_eval(step, eval_loss)
        result.eval_losses[step] = eval_loss
      checkpointer.save(step, state, train_iterator, force=final)
      result.final_step = step
      if stop:
        break
    if pending is not None:
      flush(pending)
  except jax.errors.JaxRuntimeError:
    distributed.await_failure_report()
    raise
  except BaseException:
    # Saves in flight are of earlier, finite steps: let them finish, quietly, so that the
    # error that stopped the run is the one reported.
    with contextlib.suppress(Exception):
      checkpointer.close()
    raise
  finally:
    preemption.close()
  checkpointer.close()
  if checkpointer.blocked_s:
    logging.info('Checkpoints: %d saved (%s), the loop waited median %.0f ms, max %.0f ms per '
                 'save', len(checkpointer.blocked_s),
                 'asynchronously' if config.train.async_checkpoints else 'synchronously',
                 1e3 * np.median(checkpointer.blocked_s), 1e3 * max(checkpointer.blocked_s))
  if preemption.signal_name and result.final_step < num_steps:
    logging.info('Stopped by %s after step %d of %d; its checkpoint is in %s. Rerun the same '
                 'command to resume.', preemption.signal_name, result.final_step, num_steps,
                 checkpointer.directory)
    result.preempted = True
  writer.close()
  return result
