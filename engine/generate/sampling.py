"""Text generation from a run's checkpoint, with a fixed-size key/value cache.

  python -m engine.generate --workdir=/tmp/shakespeare --prompt="ROMEO:" --max_new_tokens=50

Prompts are right-padded to --max_prompt_len and the cache holds max_prompt_len +
max_new_tokens positions, so the prefill (all prompt positions at once) and the decode step (one
new token per row) each compile once, whatever the prompts. Row b's prompt of n_b tokens fills
cache slots [0, n_b); its t-th new token sits at position n_b + t, writes its keys and values to
that slot and attends to the slots before it (the padding slots past n_b are overwritten before
anything reads them). The model is the training code's own (engine/parallel/decode.py's
DecodeOps gives it per-row positions and the cached attention, and compiles the two steps);
parameters and cache are laid out by the run's rules on the generation mesh (`--mesh`; heads
over `tensor` shard the cache too). The cache holds the N key / value heads (Llama's
num_kv_heads): H / N times fewer bytes than one per query head. This module sizes the cache,
encodes the prompts, samples, and drives the steps (Generator).

Sampling: greedy at temperature 0, else softmax(logits / temperature) restricted to the top_k
tokens and the top_p probability mass, from a key folded from --seed and the step: the same
seed gives the same samples. The command and the training loop's samples default to nanoGPT's
choice, temperature 0.8 among the 200 likeliest tokens (DEFAULT_TEMPERATURE, DEFAULT_TOP_K);
`Sampling()` itself is greedy. A row stops at the tokenizer's end-of-text token, if it has one.

Each prompt starts with the tokenizer's beginning-of-text token, if it has one, as every training
document does (engine.data.prepare); --noadd_bos leaves it out. It takes a cache slot of its own:
--max_prompt_len counts the prompt's tokens after it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from engine.assemble import Run, assemble_finished_run
from engine.workdir.checkpoint import restore_params
from engine.data.prompts import bos_ids, encode_prompt, encode_prompts
from engine.models.layers import LAYERS
from engine.parallel.decode import build_decode_steps, cache_axes, cache_names
from engine.state import TrainSetup
from engine.errors import ConfigError

# engine.generate's defaults, nanoGPT's: greedy decoding of a small model repeats itself ("the
# the the"); a warm draw among the likeliest tokens reads like the training text.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 200


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.0  # 0: greedy.
  top_k: int = 0  # 0: all tokens.
  top_p: float = 1.0


def sample(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Next token per row: argmax at temperature 0, else a draw from the restricted softmax."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
  low = jnp.finfo(jnp.float32).min
  if 0 < sampling.top_k < logits_BV.shape[-1]:  # A k of the whole vocabulary restricts nothing.
    kth = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth, low, logits_BV)
  if sampling.top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    mass_BV = jnp.cumsum(jax.nn.softmax(sorted_BV, axis=-1), axis=-1)
    # The smallest logit still inside the top_p mass (the first token always is).
    keep = jnp.sum(mass_BV - jax.nn.softmax(sorted_BV, axis=-1) < sampling.top_p, axis=-1)
    cutoff = jnp.take_along_axis(sorted_BV, keep[:, None] - 1, axis=-1)
    logits_BV = jnp.where(logits_BV < cutoff, low, logits_BV)
  return jax.random.categorical(key, logits_BV).astype(jnp.int32)


class Generator:
  """The compiled prefill and decode step of one setup, prompt length and cache size
  (engine.parallel.decode), with this sampling, and the loop that drives them."""

  def __init__(self, setup: TrainSetup, max_prompt_len: int, max_new_tokens: int,
               sampling: Sampling = Sampling(), tokenizer_vocab: int | None = None):
    self.setup, self.sampling = setup, sampling
    # The model's vocabulary is the tokenizer's rounded up: ids past the tokenizer's never come.
    self.tokenizer_vocab = tokenizer_vocab
    self.max_prompt_len, self.slots = max_prompt_len, max_prompt_len + max_new_tokens
    self.names = cache_names(setup)
    if setup.model.latent_cache:  # (latent, rotary key) per position.
      self.shapes = tuple((size,) for size in setup.model.latent_cache)
    else:
      # (kv heads, head_dim): the cache's last dimensions, from any stacked parameter that has
      # both (a key or value projection; GPT: the query or output projection), by logical name.
      heads_axis = cache_axes(setup)[3]
      heads_shape = next(
          (p.shape[p.logical_axes.index(heads_axis)], p.shape[p.logical_axes.index('head_dim')])
          for p in setup.parameters()
          if LAYERS in p.logical_axes and {heads_axis, 'head_dim'} <= set(p.logical_axes))
      self.shapes = (heads_shape, heads_shape)
    steps = build_decode_steps(setup, self._empty_cache, self._pick)
    self.prefill, self.decode = steps.prefill, steps.decode

  def _empty_cache(self, batch: int) -> dict:
    lead = (self.setup.model.num_layers, batch, self.slots)
    dtype = jnp.dtype(self.setup.options.compute_dtype)
    return {name: jnp.zeros(lead + shape, dtype) for name, shape in zip(self.names, self.shapes)}

  def cache_bytes(self, batch: int) -> int:
    """The key / value cache's bytes for `batch` rows (keys and values, all devices)."""
    cache = jax.eval_shape(lambda: self._empty_cache(batch))
    return sum(a.size * a.dtype.itemsize for a in cache.values())

  def _log_cache(self, rows: int) -> None:
    size = (self.setup.model.num_layers, rows, self.slots)
    mib = self.cache_bytes(rows) / 2**20
    if self.setup.model.latent_cache:
      logging.info('Latent cache: %d layers x %d rows x %d slots x (%d latent + %d rotary key): '
                   '%.2f MiB.', *size, *self.setup.model.latent_cache, mib)
      return
    heads = self.setup.attention_heads()['query']
    logging.info('Key/value cache: %d layers x %d rows x %d slots x %d kv heads x %d head_dim, '
                 'keys and values: %.2f MiB (%d query heads: %gx less than a head each).',
                 *size, *self.shapes[0], mib, heads, heads / self.shapes[0][0])

  def _pick(self, logits_BV, key):
    return sample(self._known(logits_BV), key, self.sampling)

  def _known(self, logits_BV):
    if self.tokenizer_vocab is None or self.tokenizer_vocab >= logits_BV.shape[-1]:
      return logits_BV
    known_V = jnp.arange(logits_BV.shape[-1]) < self.tokenizer_vocab
    return jnp.where(known_V, logits_BV, jnp.finfo(logits_BV.dtype).min)

  def generate(self, params, prompts: list[np.ndarray], max_new_tokens: int, seed: int = 0,
               eos_id: int | None = None) -> list[np.ndarray]:
    """New tokens for each prompt (ids), up to max_new_tokens, cut after an end-of-text."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1 or lengths.max() > self.max_prompt_len:
      raise ConfigError(
          f'prompt lengths {lengths.min()}..{lengths.max()} tokens: each must have 1 to '
          f'--max_prompt_len={self.max_prompt_len} tokens.')
    if self.max_prompt_len + max_new_tokens > self.slots:
      raise ConfigError(f'max_new_tokens={max_new_tokens} exceeds the cache.')
    # Rows padded to a multiple of the batch axes' devices with copies of the first prompt.
    ways = math.prod(self.setup.mesh.shape[a] for a in self.setup.rules.mesh_axes('batch', True))
    asked = len(prompts)
    prompts = list(prompts) + [prompts[0]] * (-asked % ways)
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), self.max_prompt_len), np.int32)
    for row, prompt in enumerate(prompts):
      tokens[row, :len(prompt)] = prompt
    key = jax.random.key(seed)
    self._log_cache(len(prompts))
    cache, next_B = self.prefill(params, tokens, lengths, jax.random.fold_in(key, 0))
    out, done = [], np.zeros(len(prompts), bool)
    for step in range(max_new_tokens):
      host = np.asarray(next_B)
      out.append(host)
      done |= (host == eos_id) if eos_id is not None else False
      done[asked:] = True  # Padding rows never hold generation back.
      if done.all() or step == max_new_tokens - 1:
        break
      cache, next_B = self.decode(params, cache, next_B, jnp.asarray(lengths + step),
                                  jax.random.fold_in(key, step + 1))
    columns = np.stack(out, axis=1)[:asked]
    results = []
    for row in columns:
      stop = np.flatnonzero(row == eos_id) if eos_id is not None else []
      results.append(row[:stop[0] + 1] if len(stop) else row)
    return results


def load_run(workdir: str, mesh: str = '1x1x1') -> tuple[Run, object]:
  """A finished run laid out on `mesh` (engine.assemble), and its latest checkpoint's
  parameters."""
  run = assemble_finished_run(workdir, mesh)
  return run, restore_params(workdir, run.setup.abstract_state()['params'])


def prompts_and_slots(config, tokenizer, texts: list[str], max_prompt_len: int,
                      max_new_tokens: int, add_bos: bool) -> tuple[list[np.ndarray], int]:
  """The prompts' ids (encode_prompts) and the Generator's prompt slots: --max_prompt_len
  (default: the longest prompt, as rotary positions have no cap; GPT: what its learned positions
  leave after max_new_tokens) counts a prompt's tokens, the beginning-of-text token takes one
  slot more (and, in GPT's default, one token less of the prompt)."""
  ids = encode_prompts(tokenizer, texts, add_bos)
  bos = len(bos_ids(tokenizer, add_bos))
  prompt_len = max_prompt_len or (max(1, max(len(i) for i in ids) - bos)
                                  if config.model.name != 'gpt' else
                                  max(1, config.model.max_len - max_new_tokens - bos))
  plus = ' + 1 beginning-of-text token' if bos else ''
  if config.model.name == 'gpt' and max_new_tokens + bos >= config.model.max_len:
    raise ConfigError(
        f'--max_new_tokens={max_new_tokens}{plus} leaves no room for a prompt in the GPT '
        f'model\'s {config.model.max_len} learned positions (model.max_len); give '
        f'--max_new_tokens below {config.model.max_len - bos}.')
  if config.model.name == 'gpt' and prompt_len + bos + max_new_tokens > config.model.max_len:
    raise ConfigError(
        f'--max_prompt_len={prompt_len}{plus} + --max_new_tokens={max_new_tokens} exceeds the '
        f'GPT model\'s {config.model.max_len} learned positions; shorten them.')
  # The cache attends within the window; latent attention computes none (an older run's config
  # gains both keys: run_dir.upgrade).
  window = config.model.sliding_window if config.model.get('mla_kv_rank', 0) else 0
  if window and prompt_len + bos + max_new_tokens > window:
    raise ConfigError(
        f'--max_prompt_len={prompt_len}{plus} + --max_new_tokens={max_new_tokens} exceeds the '
        f'model\'s sliding window of {window} tokens (model.sliding_window), past which '
        'latent attention\'s full attention would differ from the model\'s; shorten them.')
  if not bos and min(len(i) for i in ids) == 0:
    raise ConfigError('a prompt is empty, and the run\'s tokenizer has no '
                      'beginning-of-text token to start from; give it some text.')
  longest = max(len(i) for i in ids) - bos
  if longest > prompt_len:
    raise ConfigError(
        f'a prompt has {longest} tokens, more than --max_prompt_len={prompt_len}{plus}; raise '
        '--max_prompt_len or shorten the prompt.')
  return ids, prompt_len + bos


DEFAULT_NEW_TOKENS = 100  # --max_new_tokens=0 for a model without learned positions.


def resolve_new_tokens(config, tokenizer, texts: list[str], max_new_tokens: int,
                       max_prompt_len: int, add_bos: bool) -> int:
  """--max_new_tokens, or by default (0) DEFAULT_NEW_TOKENS; for GPT, whose learned positions
  cap prompt and sample together, what they leave after the prompt slots."""
  if max_new_tokens or config.model.name != 'gpt':
    return max_new_tokens or DEFAULT_NEW_TOKENS
  bos = len(bos_ids(tokenizer, add_bos))
  slots = bos + (max_prompt_len or max(len(encode_prompt(tokenizer, t)) for t in texts))
  if slots >= config.model.max_len:
    raise ConfigError(
        f'the prompt slots ({slots}) fill the GPT model\'s {config.model.max_len} learned '
        'positions (model.max_len), leaving none to generate; shorten the prompts or '
        '--max_prompt_len.')
  logging.info('--max_new_tokens: %d, what the GPT model\'s %d learned positions leave after '
               '%d prompt slots.', config.model.max_len - slots, config.model.max_len, slots)
  return config.model.max_len - slots


def check_sampling_flags(max_new_tokens: int, max_prompt_len: int, num_samples: int,
                         sampling: 'Sampling') -> None:
  """Generation flags outside their ranges, each refused in one line before anything loads."""
  checks = [
      (max_new_tokens >= 0, f'--max_new_tokens={max_new_tokens} must be >= 0 (0: '
       f'{DEFAULT_NEW_TOKENS}, or what a GPT model\'s learned positions leave).'),
      (max_prompt_len >= 0, f'--max_prompt_len={max_prompt_len} must be >= 0 (0: the longest '
       'prompt\'s length).'),
      (num_samples >= 1, f'--num_samples={num_samples} must be at least 1.'),
      (math.isfinite(sampling.temperature) and sampling.temperature >= 0,
       f'--temperature={sampling.temperature:g} must be a finite number >= 0 (0: greedy).'),
      (sampling.top_k >= 0, f'--top_k={sampling.top_k} must be >= 0 (0: every token).'),
      (0 < sampling.top_p <= 1, f'--top_p={sampling.top_p:g} must lie in (0, 1] (1: every '
       'token).')]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
