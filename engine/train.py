"""The training loop: validate -> mesh -> data -> init or restore -> steps -> eval -> checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from engine import config as config_lib
from engine import data, distributed, models, parallel, sharding
from engine import state as state_lib
from engine.checkpoint import Checkpointer
from engine.mesh import make_mesh
from engine.metrics import MetricsWriter, log_memory


@dataclasses.dataclass
class TrainResult:
  """What a run reports back: per-step train losses that were logged, eval losses, last step."""
  train_losses: dict[int, float]
  eval_losses: dict[int, float]
  final_step: int
  memory: dict[str, dict[str, int]]


def resolve_vocab_size(model_config, tokenizer_vocab: int) -> int:
  """The model's vocabulary: the config's, or the tokenizer's rounded up to `vocab_multiple`."""
  if model_config.vocab_size == -1:
    return math.ceil(tokenizer_vocab / model_config.vocab_multiple) * model_config.vocab_multiple
  if model_config.vocab_size < tokenizer_vocab:
    raise config_lib.ConfigError(
        f'model.vocab_size={model_config.vocab_size} is smaller than the tokenizer\'s '
        f'{tokenizer_vocab} tokens; raise it or set it to -1.')
  return model_config.vocab_size


def build_layout(config: ml_collections.ConfigDict, tokenizer_vocab: int) -> state_lib.StateLayout:
  """Mesh, rules, model and optimizer of a validated config: everything but the data."""
  mesh = make_mesh(config.mesh)
  rules = sharding.rules_for(config.parallelism.rules, dict(mesh.shape))
  vocab_size = resolve_vocab_size(config.model, tokenizer_vocab)
  model_factory = models.MODELS[config.model.name](config.model, vocab_size)
  tx = state_lib.make_optimizer(config.optim, config.train.num_steps)
  return state_lib.make_layout(model_factory, tx, config.optim.grad_clip_norm, mesh, rules)


def setup(config: ml_collections.ConfigDict) -> tuple[data.Corpus, state_lib.StateLayout]:
  """Validates the config (before anything compiles), reads the data, derives the layout."""
  config_lib.validate(config, jax.device_count(), jax.process_count())
  corpus = data.load_corpus(config.data, config.seed)
  return corpus, build_layout(config, corpus.tokenizer.vocab_size)


def _check_resumable(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuses to resume a checkpoint whose model or data config differ from this one: the state
  would not fit, or the run would silently change. Mesh, mode and schedule may change."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  for section in ('model', 'data'):
    if saved.get(section) != json.loads(config[section].to_json()):
      raise config_lib.ConfigError(
          f'--workdir={workdir} holds checkpoints of a run with a different {section} config; '
          f'use a new --workdir, or the {section} settings of {path}.')


def _write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Records the config once the run is known to start (never for a run that failed early)."""
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json(indent=2))


def train(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Trains (or resumes) the experiment `config` in `workdir`."""
  corpus, layout = setup(config)
  os.makedirs(workdir, exist_ok=True)
  mesh, rules = layout.mesh, layout.rules
  logging.info('Mesh %s, mode %s, rules %s; %s tokenizer, vocab %d (model %d), %d train tokens',
               dict(mesh.shape), config.parallelism.mode, config.parallelism.rules,
               config.data.tokenizer, corpus.tokenizer.vocab_size,
               layout.abstract_params['tok_embed_VD'].shape[0], len(corpus.train_tokens))
  num_steps = config.train.num_steps
  schedule = state_lib.learning_rate_schedule(config.optim, num_steps)
  steps = parallel.STEP_BUILDERS[config.parallelism.mode](layout)
  batch_sharding = state_lib.batch_sharding(mesh, rules)
  num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(layout.abstract_params))
  logging.info('Model %s: %.3fM parameters', config.model.name, num_params / 1e6)

  train_iterator = data.train_iterator(corpus, config.data, config.seed)
  checkpointer = Checkpointer(os.path.join(workdir, 'checkpoints'),
                              config.train.checkpoint_every, config.train.keep_checkpoints)
  memory = {}
  abstract_state = layout.abstract_state()
  # Every process must resume from the same step; process 0's view decides.
  latest = checkpointer.latest_step()
  start_step = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if latest is None else latest)))
  if start_step < 0:
    state, init_compiled = layout.init(config.seed)
    memory['init'] = log_memory('init', init_compiled)
    start_step = 0
  else:
    _check_resumable(config, workdir)
    state = checkpointer.restore(start_step, abstract_state, train_iterator)
  logging.info('Parameters per device: %.2f MiB',
               sharding.bytes_per_device(state['params']) / 2**20)

  global_batch = config.data.global_batch_size
  abstract_batch = jax.ShapeDtypeStruct((global_batch, config.data.seq_len + 1), np.int32,
                                        sharding=batch_sharding)
  train_step = steps.train.lower(abstract_state, abstract_batch).compile()
  memory['train_step'] = log_memory('train step', train_step)
  eval_step = steps.eval.lower(abstract_state['params'], abstract_batch).compile()
  eval_data = [data.to_global(b, batch_sharding, global_batch)
               for b in data.eval_batches(corpus, config.data, config.seed,
                                          config.train.eval_batches)]

  _write_config(config, workdir)
  writer = MetricsWriter(workdir, num_steps, global_batch * config.data.seq_len)
  result = TrainResult({}, {}, start_step, memory)
  pending = None  # Metrics of the last step to log, fetched once the next step is dispatched.

  def flush(pending):
    step, metrics = pending
    metrics = jax.device_get(metrics)
    loss = float(metrics['loss'])
    if not math.isfinite(loss):
      raise FloatingPointError(f'Training loss is {loss} at step {step}; lower '
                               'optim.learning_rate or check the data.')
    writer.log_train(step, loss, float(schedule(step - 1)), float(metrics['grad_norm']))
    result.train_losses[step] = loss

  if start_step >= num_steps:
    logging.info('The checkpoint in %s is at step %d, train.num_steps=%d: nothing to train.',
                 workdir, start_step, num_steps)
  # Gloo's CPU collectives across processes hang with two steps in flight (seen with 2
  # processes x 4 devices, within the first 50 steps); there, the next step is dispatched only
  # once this one is done. Accelerators keep the overlap.
  lockstep = jax.process_count() > 1 and jax.default_backend() == 'cpu'
  writer.start_clock(start_step)
  try:
    for step in range(start_step + 1, num_steps + 1):
      batch = data.to_global(next(train_iterator), batch_sharding, global_batch)
      state, metrics = train_step(state, batch)
      if lockstep:
        jax.block_until_ready(state)
      if pending is not None:
        flush(pending)
        pending = None
      if step % config.train.log_every == 0 or step == num_steps:
        pending = (step, metrics)
      if step % config.train.eval_every == 0 or step == num_steps:
        eval_loss = float(np.mean([eval_step(state['params'], b) for b in eval_data]))
        writer.log_eval(step, eval_loss)
        result.eval_losses[step] = eval_loss
      checkpointer.save(step, state, train_iterator, force=step == num_steps)
      result.final_step = step
    if pending is not None:
      flush(pending)
  except jax.errors.JaxRuntimeError:
    distributed.await_failure_report()
    raise
  checkpointer.close()
  writer.close()
  return result
