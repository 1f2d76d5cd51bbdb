"""The corpus (a tokenized source, or shard sets), grain pipelines, and per-process loading into
global jax.Arrays.

Training examples are windows of `seq_len + 1` tokens at shuffled start positions. The global
batch of step s is records [s*B, (s+1)*B) of that shuffled stream; process p reads only its rows
[p*b, (p+1)*b) of it (b = B / processes), so the global batch is the same for any process count.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import grain
import jax
import numpy as np

from engine.errors import ConfigError
from engine.data import shard_meta
from engine.data import shards as shards_lib
from engine.data import tokenizers as tokenizer_lib
from engine.data.sources import load_text


def _train_split(num_tokens: int, val_fraction: float) -> int:
  """How many of the first tokens train; the rest are held out."""
  return int(num_tokens * (1 - val_fraction))


def _splits(num_tokens: int, val_fraction: float, min_len: int) -> bool:
  """Whether both the train and the held-out part hold at least `min_len` tokens."""
  split = _train_split(num_tokens, val_fraction)
  return min(split, num_tokens - split) >= min_len


def _fewest_tokens(val_fraction: float, min_len: int) -> int:
  """The smallest corpus that splits: from the estimate, a few steps either way (rounding)."""
  n = math.ceil(min_len / min(val_fraction, 1 - val_fraction))
  while not _splits(n, val_fraction, min_len):
    n += 1
  while _splits(n - 1, val_fraction, min_len):
    n -= 1
  return n


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A tokenized source: in memory (text sources), or shard sets streamed from disk."""
  tokenizer: object  # engine.data.tokenizers's: vocab_size, encode, decode, eos_id.
  train_tokens: np.ndarray | None = None
  val_tokens: np.ndarray | None = None
  shard_sets: tuple[tuple[shards_lib.TokenStream, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class RecordedTokenizer:
  """The tokenizer a shard set was written with, as its meta.json records it, and the file
  (checked against that record) that decodes its ids ('' for bytes)."""
  kind: str
  vocab_size: int
  eos_id: int | None
  path: str = ''


def load_shards(data_config) -> Corpus:
  """The shard sets of `data.shards` (engine.data.prepare's output), opened and checked against
  their meta.json and the run's data.tokenizer (engine/data/shard_meta.py), not read."""
  sets = [(shards_lib.TokenStream(d), w) for d, w in shards_lib.parse_sets(data_config.shards)]
  files = [shard_meta.check_tokenizer(s.meta, s.directory, data_config, shards_lib.sha256,
                                      functools.partial(s.record, 0)) for s, _ in sets]
  recorded = {(s.meta['tokenizer']['kind'], s.meta['tokenizer']['vocab_size'],
               s.meta['tokenizer']['eos_id']) for s, _ in sets}
  if len(recorded) > 1 or len({shards_lib.sha256(f) for f in files if f}) > 1:
    raise ConfigError(f'data.shards={data_config.shards!r}: the shard sets were written with '
                      f'different tokenizers {sorted(recorded, key=str)} (files '
                      f'{sorted(set(files))}); mix sets of one tokenizer.')
  conversations = [s.directory for s, _ in sets if 'chat' in s.meta]
  if conversations and not data_config.document_masking:
    raise ConfigError(f'data.shards: {conversations[0]!r} holds conversations, whose loss trains '
                      'on the answers only and stays within each conversation; pass '
                      '--config.data.document_masking=true.')
  for stream, _ in sets:
    windows = len(shards_lib.PackedWindows(stream, data_config.seq_len))
    if _train_split(windows, data_config.val_fraction) < 1 or windows - _train_split(
        windows, data_config.val_fraction) < 1:
      raise ConfigError(f'data.shards: {stream.directory!r} holds {stream.num_tokens} tokens, '
                        f'too few for a train and a validation window of data.seq_len='
                        f'{data_config.seq_len}; prepare more text or shorten the sequences.')
  return Corpus(RecordedTokenizer(*recorded.pop(), files[0]), shard_sets=tuple(sets))


def load_corpus(data_config, seed: int) -> Corpus:
  """Reads and tokenises the source; the last `val_fraction` of it is held out (shards: of
  each set's packed windows)."""
  if data_config.source == 'shards':
    return load_shards(data_config)
  text = load_text(data_config, seed)
  tokenizer = tokenizer_lib.load(data_config.tokenizer, data_config.tokenizer_path, text)
  tokens = tokenizer.encode(text)
  if data_config.source == 'file' and not text:
    raise ConfigError(f'data.path={data_config.path!r} is empty; pass a text file with the '
                      'training text, or use --config.data.source=embedded.')
  min_len = data_config.seq_len + 2
  if not _splits(len(tokens), data_config.val_fraction, min_len):
    source = (f'data.path={data_config.path!r}' if data_config.source == 'file' else
              f'data.source={data_config.source!r}')
    raise ConfigError(
        f'{source} holds {len(tokens)} tokens, too few to split into train and validation parts '
        f'of at least data.seq_len+2={min_len} tokens each (data.val_fraction='
        f'{data_config.val_fraction}: {_fewest_tokens(data_config.val_fraction, min_len)} tokens '
        'or more); use a larger source or a shorter data.seq_len.')
  split = _train_split(len(tokens), data_config.val_fraction)
  return Corpus(tokenizer, tokens[:split], tokens[split:])


def windows_dataset(tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                    process_index: int, process_count: int) -> grain.MapDataset:
  """This process's slice of every global batch: element s is an int32 [B/P, seq_len+1] array."""
  local_batch = global_batch // process_count
  starts = grain.MapDataset.range(len(tokens) - seq_len).shuffle(seed=seed).repeat(None)
  windows = starts.map(lambda start: tokens[start:start + seq_len + 1])
  batches = windows.batch(local_batch, drop_remainder=True)
  return batches[process_index::process_count]


def describe(corpus: Corpus) -> str:
  """How much text a corpus holds, for the log."""
  if corpus.shard_sets:
    return ', '.join(f'{s.directory}: {s.num_tokens} tokens (weight {w:.2f})'
                     for s, w in corpus.shard_sets)
  return f'{len(corpus.train_tokens)} train tokens'


def _shard_windows(corpus: Corpus, data_config, split: str, seed: int) -> grain.MapDataset:
  """Packed windows of every shard set (train: the first 1 - val_fraction of each set's
  windows, shuffled and repeated; val: the rest), mixed by the sets' weights."""
  datasets, weights = [], []
  for stream, weight in corpus.shard_sets:
    windows = grain.MapDataset.source(shards_lib.PackedWindows(stream, data_config.seq_len))
    cut = _train_split(len(windows), data_config.val_fraction)
    part = windows[:cut] if split == 'train' else windows[cut:]
    datasets.append(part.shuffle(seed=seed).repeat(None))
    weights.append(weight)
  return datasets[0] if len(datasets) == 1 else grain.MapDataset.mix(datasets, weights)


def batches(corpus: Corpus, data_config, split: str, global_batch: int, seed: int,
            process_index: int, process_count: int) -> grain.MapDataset:
  """This process's rows of every global batch of `split` ('train' or 'val'): int32
  [global_batch / processes, seq_len + 1]."""
  if corpus.shard_sets:
    local_batch = global_batch // process_count
    windows = _shard_windows(corpus, data_config, split, seed)
    return windows.batch(local_batch, drop_remainder=True)[process_index::process_count]
  tokens = corpus.train_tokens if split == 'train' else corpus.val_tokens
  return windows_dataset(tokens, data_config.seq_len, global_batch, seed, process_index,
                         process_count)


def train_iterator(corpus: Corpus, data_config, seed: int) -> grain.DatasetIterator:
  """A checkpointable iterator over this process's training batches."""
  dataset = batches(corpus, data_config, 'train', data_config.global_batch_size, seed,
                    jax.process_index(), jax.process_count())
  return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


def eval_batches(corpus: Corpus, data_config, seed: int, num_batches: int) -> list[np.ndarray]:
  """The same fixed held-out batches at every evaluation, so eval losses are comparable."""
  dataset = batches(corpus, data_config, 'val', data_config.global_batch_size, seed + 1,
                    jax.process_index(), jax.process_count())
  return [dataset[i] for i in range(num_batches)]


def to_global(local_batch: np.ndarray, sharding: jax.sharding.Sharding,
              global_batch: int) -> jax.Array:
  """Assembles the global batch from every process's local rows (one process: all of them)."""
  global_shape = (global_batch,) + local_batch.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local_batch, global_shape)
