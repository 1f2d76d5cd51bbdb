"""Tiny configs and the single-device reference runs that parallel runs must match."""

import numpy as np

from engine import data, models
from engine.config import default_config
from engine.reference import ReferenceRun
from engine.train import resolve_vocab_size


def tiny_config(mesh=(1, 1, 1), steps=4, source='synthetic'):
  """A 2-layer width-32 GPT on synthetic text: small enough for many compiles on 2 cores."""
  c = default_config()
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.embed_dim = 32
  c.model.mlp_dim = 64
  c.model.max_len = 16
  c.data.source = source
  c.data.seq_len = 16
  c.data.global_batch_size = 16
  c.data.synthetic_tokens = 20_000
  c.optim.warmup_steps = 0  # Every step moves the parameters.
  c.optim.learning_rate = 3e-3
  c.train.num_steps = steps
  c.train.log_every = 1
  c.train.eval_every = steps
  c.train.eval_batches = 2
  c.train.checkpoint_every = steps
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def single_device_run(config, num_steps):
  """`num_steps` steps of engine.reference on the engine's batch stream: (losses, params)."""
  corpus = data.load_corpus(config.data, config.seed)
  vocab = resolve_vocab_size(config.model, corpus.tokenizer.vocab_size)
  run = ReferenceRun(models.MODELS[config.model.name](config.model, vocab), config.optim,
                     config.train.num_steps, config.seed)
  batches = data.windows_dataset(corpus.train_tokens, config.data.seq_len,
                                 config.data.global_batch_size, config.seed, 0, 1)
  losses = [run.step(batches[i])['loss'] for i in range(num_steps)]
  return np.array(losses), run.params
