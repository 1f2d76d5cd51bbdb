"""Text generation from a run's checkpoint, with a fixed-size key/value cache.

  python -m engine.generate --workdir=/tmp/shakespeare --prompt="ROMEO:" --max_new_tokens=50

Prompts are right-padded to --max_prompt_len and the cache holds max_prompt_len +
max_new_tokens positions, so the prefill (all prompt positions at once) and the decode step (one
new token per row) each compile once, whatever the prompts. Row b's prompt of n_b tokens fills
cache slots [0, n_b); its t-th new token sits at position n_b + t, writes its keys and values to
that slot and attends to the slots before it (the padding slots past n_b are overwritten before
anything reads them). The model is the training code's own (`DecodeOps` gives it per-row
positions and the cached attention); parameters and cache are laid out by the run's rules on
the generation mesh (`--mesh`; heads over `tensor` shard the cache too). The cache holds the N
key / value heads (Llama's num_kv_heads): H / N times fewer bytes than one per query head.

Sampling: greedy at temperature 0, else softmax(logits / temperature) restricted to the top_k
tokens and the top_p probability mass, from a key folded from --seed and the step: the same
seed gives the same samples. A row stops at the tokenizer's end-of-text token, if it has one.

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
from flax import nnx
from jax.sharding import NamedSharding

from engine import config as config_lib
from engine.assemble import Run, assemble_finished_run
from engine.workdir.checkpoint import restore_params
from engine.data import tokenizers as tokenizer_lib
from engine.models.attention import grouped_logits, grouped_values, prescale
from engine.models.layers import LAYERS, layer_group, num_groups, one_layer
from engine.parallel.auto import AutoOps
from engine.state import TrainSetup
from engine.data.text_files import read_text
from engine.errors import ConfigError

# The cache: [layers, batch, slots, kv heads, head_dim] for keys and for values ('kv_heads':
# split over `tensor` where they divide; a model without them, GPT, caches its 'heads').
CACHE_AXES = (None, 'batch', None, 'kv_heads', 'head_dim')


def cache_axes(setup: TrainSetup) -> tuple:
  """CACHE_AXES, with 'heads' for a model whose parameters name no 'kv_heads'."""
  grouped = any('kv_heads' in p.logical_axes for p in setup.parameters())
  return CACHE_AXES if grouped else CACHE_AXES[:3] + ('heads', 'head_dim')


class DecodeOps(AutoOps):
  """Auto mode's layout, with each row's own positions and attention through the cache."""

  def __init__(self, setup: TrainSetup, cache: dict, positions_BL: jax.Array):
    super().__init__(setup)
    self.cache, self.positions_BL = dict(cache), positions_BL
    self.cache_axes = cache_axes(setup)
    self._layer = 0

  def kv_for_query_heads(self, kv_BLNK, num_heads):
    # All the key / value heads, laid out as the cache: the attention groups the query heads.
    del num_heads
    return self.constrain(kv_BLNK, ('batch', 'length', 'kv_heads', 'head_dim'))

  def positions(self, length):
    del length
    return self.positions_BL

  def stack(self, run, layers, x):
    # Layer by layer in Python (not the model's scan, whose trace the cache must not leave),
    # each attending through its own slice of the cache. No remat: nothing is differentiated.
    del run
    self._layer = 0
    for group in ([layers] if num_groups(layers) == 1 else
                  [layer_group(layers, r) for r in range(num_groups(layers))]):
      for index in range(jax.tree.leaves(nnx.state(group))[0].shape[0]):
        layer = self.prepare_params(one_layer(group, index), skip_stacked=False)
        x = layer(x, self)
        self._layer += 1
    return x

  def attention(self, q_BLHK, k_BLNK, v_BLNK, scale_on='queries', implementation='einsum',
                scale=None):
    del implementation
    rows = jnp.arange(q_BLHK.shape[0])[:, None]
    for name, new in (('k', k_BLNK), ('v', v_BLNK)):
      cache = self.cache[name].at[self._layer, rows, self.positions_BL].set(
          new.astype(self.cache[name].dtype))
      self.cache[name] = self.constrain(cache, self.cache_axes)
    keys_BSNK, values_BSNK = self.cache['k'][self._layer], self.cache['v'][self._layer]
    q_BLHK, scale = prescale(q_BLHK, scale, scale_on)
    logits_BHQS = grouped_logits(q_BLHK, keys_BSNK.astype(q_BLHK.dtype)) * scale
    slots_S = jnp.arange(keys_BSNK.shape[1])
    visible_BQS = slots_S[None, None, :] <= self.positions_BL[:, :, None]
    logits_BHQS = jnp.where(visible_BQS[:, None], logits_BHQS, jnp.finfo(jnp.float32).min)
    probs_BHQS = jax.nn.softmax(logits_BHQS, axis=-1).astype(q_BLHK.dtype)
    return grouped_values(probs_BHQS, values_BSNK.astype(q_BLHK.dtype))


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
  if sampling.top_k:
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
  """The compiled prefill and decode step of one setup, prompt length and cache size."""

  def __init__(self, setup: TrainSetup, max_prompt_len: int, max_new_tokens: int,
               sampling: Sampling = Sampling(), tokenizer_vocab: int | None = None):
    self.setup, self.sampling = setup, sampling
    # The model's vocabulary is the tokenizer's rounded up: ids past the tokenizer's never come.
    self.tokenizer_vocab = tokenizer_vocab
    self.max_prompt_len, self.slots = max_prompt_len, max_prompt_len + max_new_tokens
    # (kv heads, head_dim): the cache's last dimensions, from any stacked parameter that has
    # both (a key or value projection; GPT: the query or output projection), by logical name.
    heads_axis = cache_axes(setup)[3]
    self.heads_shape = next(
        (p.shape[p.logical_axes.index(heads_axis)], p.shape[p.logical_axes.index('head_dim')])
        for p in setup.parameters()
        if LAYERS in p.logical_axes and {heads_axis, 'head_dim'} <= set(p.logical_axes))
    mesh, spec = setup.mesh, setup.rules.spec
    params = setup.state_shardings()['params']
    rows = NamedSharding(mesh, spec(('batch', None), activation=True))
    row = NamedSharding(mesh, spec(('batch',), activation=True))
    cache = NamedSharding(mesh, spec(cache_axes(setup), activation=True))
    self.prefill = jax.jit(self._prefill, in_shardings=(params, rows, row, None),
                           out_shardings=({'k': cache, 'v': cache}, row))
    self.decode = jax.jit(self._decode, in_shardings=(params, {'k': cache, 'v': cache}, row, row,
                                                      None),
                          out_shardings=({'k': cache, 'v': cache}, row), donate_argnums=1)

  def _model(self, params, ops):
    return ops.prepare_params(nnx.merge(self.setup.graphdef, params))

  def _empty_cache(self, batch: int) -> dict:
    shape = (self.setup.model.num_layers, batch, self.slots) + self.heads_shape
    dtype = jnp.dtype(self.setup.options.compute_dtype)
    return {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)}

  def cache_bytes(self, batch: int) -> int:
    """The key / value cache's bytes for `batch` rows (keys and values, all devices)."""
    cache = jax.eval_shape(lambda: self._empty_cache(batch))
    return sum(a.size * a.dtype.itemsize for a in cache.values())

  def _prefill(self, params, tokens_BP, lengths_B, key):
    batch = tokens_BP.shape[0]
    positions_BP = jnp.broadcast_to(jnp.arange(tokens_BP.shape[1]), tokens_BP.shape)
    ops = DecodeOps(self.setup, self._empty_cache(batch), positions_BP)
    logits_BPV = self._model(params, ops)(tokens_BP, ops)
    last_BV = jnp.take_along_axis(logits_BPV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]
    return ops.cache, sample(self._known(last_BV), key, self.sampling)

  def _decode(self, params, cache, tokens_B, positions_B, key):
    ops = DecodeOps(self.setup, cache, positions_B[:, None])
    logits_BV = self._model(params, ops)(tokens_B[:, None], ops)[:, 0]
    return ops.cache, sample(self._known(logits_BV), key, self.sampling)

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
    heads = self.setup.attention_heads()['query']
    logging.info('Key/value cache: %d layers x %d rows x %d slots x %d kv heads x %d head_dim, '
                 'keys and values: %.2f MiB (%d query heads: %gx less than a head each).',
                 self.setup.model.num_layers, len(prompts), self.slots, *self.heads_shape,
                 self.cache_bytes(len(prompts)) / 2**20, heads, heads / self.heads_shape[0])
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


def encode_prompt(tokenizer, text: str, what: str = '--prompt') -> np.ndarray:
  """The text's ids; a clear error for characters outside a character vocabulary."""
  if isinstance(tokenizer, tokenizer_lib.CharTokenizer):
    unknown = sorted(set(text) - set(tokenizer.chars))
    if unknown:
      raise ConfigError(
          f'{what} has characters the run\'s character vocabulary lacks: {unknown[:20]}; use '
          f'only these {len(tokenizer.chars)}: {tokenizer.chars!r}.')
  return tokenizer.encode(text)


def bos_ids(tokenizer, add_bos: bool = True) -> list[int]:
  """[the tokenizer's beginning-of-text id] with add_bos if it has one (each document of the
  training stream starts with it: engine.data.prepare), else []."""
  return [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []


def encode_prompts(tokenizer, texts: list[str], add_bos: bool = True,
                   what: str = '--prompt') -> list[np.ndarray]:
  """Each text's ids (encode_prompt), after the beginning-of-text id (bos_ids)."""
  first = np.asarray(bos_ids(tokenizer, add_bos), np.int32)
  return [np.concatenate([first, encode_prompt(tokenizer, text, what)]) for text in texts]


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
  window = config.model.get('sliding_window', 0)
  if window and prompt_len + bos + max_new_tokens > window:
    raise ConfigError(
        f'--max_prompt_len={prompt_len}{plus} + --max_new_tokens={max_new_tokens} exceeds the '
        f'model\'s sliding window of {window} tokens (model.sliding_window), past which the '
        'engine\'s full attention would differ from the model\'s; shorten them.')
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
