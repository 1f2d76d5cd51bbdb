"""Tiny configs and the independent single-device reference that parallel runs must match."""

import jax
import numpy as np
import optax
from flax import nnx

from engine import data, models
from engine import state as state_lib
from engine.config import default_config
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
  """The plain computation on one device: no mesh, no shardings, no ops layer.

  Same model definition, initial key, optimizer and batch stream as the engine; returns the
  per-step losses and final parameters.
  """
  corpus = data.load_corpus(config.data, config.seed)
  vocab = resolve_vocab_size(config.model, corpus.tokenizer.vocab_size)
  factory = models.MODELS[config.model.name](config.model, vocab)
  device = jax.devices()[0]
  with jax.default_device(device):
    model = factory(nnx.Rngs(params=jax.random.key(config.seed)))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    tx = optax.chain(optax.clip_by_global_norm(config.optim.grad_clip_norm),
                     state_lib.make_optimizer(config.optim, config.train.num_steps))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
      def loss_fn(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    batches = data.windows_dataset(corpus.train_tokens, config.data.seq_len,
                                   config.data.global_batch_size, config.seed, 0, 1)
    losses = []
    for i in range(num_steps):
      params, opt_state, loss = step(params, opt_state, jax.device_put(batches[i], device))
      losses.append(float(loss))
  return np.array(losses), params
