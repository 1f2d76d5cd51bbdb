"""Text sources, tokenisers, grain pipelines, and per-process loading into global jax.Arrays.

Sources: a text file, an embedded default corpus (the Python standard library's own `.py`
sources, present on every machine with Python), and a seeded synthetic Markov text for tests.
Training examples are windows of `seq_len + 1` tokens at shuffled start positions. The global
batch of step s is records [s*B, (s+1)*B) of that shuffled stream; process p reads only its rows
[p*b, (p+1)*b) of it (b = B / processes), so the global batch is the same for any process count.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig

import grain
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """Byte-level (256 ids) or character-level (the sorted characters of the corpus)."""
  kind: str
  chars: str = ''  # Character vocabulary, for kind='char'.

  @classmethod
  def fit(cls, kind: str, text: str) -> Tokenizer:
    return cls(kind, ''.join(sorted(set(text))) if kind == 'char' else '')

  @property
  def vocab_size(self) -> int:
    return 256 if self.kind == 'byte' else len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    if self.kind == 'byte':
      return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)
    index = {c: i for i, c in enumerate(self.chars)}
    return np.fromiter((index[c] for c in text), np.int32, len(text))

  def decode(self, ids) -> str:
    if self.kind == 'byte':
      return bytes(int(i) for i in ids).decode('utf-8', errors='replace')
    return ''.join(self.chars[int(i)] for i in ids)


def embedded_corpus(max_bytes: int) -> str:
  """The standard library's top-level `.py` files, in name order: real text on every machine."""
  stdlib = sysconfig.get_paths()['stdlib']
  parts, size = [], 0
  for path in sorted(glob.glob(os.path.join(stdlib, '*.py'))):
    with open(path, encoding='utf-8', errors='replace') as f:
      parts.append(f'# ---- {os.path.basename(path)}\n' + f.read())
    size += len(parts[-1])
    if size >= max_bytes:
      break
  return ''.join(parts)[:max_bytes]


def synthetic_corpus(num_tokens: int, seed: int) -> str:
  """Seeded text from a sparse first-order Markov chain over 32 letters: learnable, tiny."""
  rng = np.random.default_rng(seed)
  alphabet = np.array(list('abcdefghijklmnopqrstuvwxyz .,;\n!'))
  successors = rng.integers(0, len(alphabet), size=(len(alphabet), 3))
  state, out = 0, np.empty(num_tokens, np.int64)
  choices = rng.integers(0, 3, size=num_tokens)
  for i in range(num_tokens):
    state = successors[state, choices[i]]
    out[i] = state
  return ''.join(alphabet[out])


def load_text(data_config, seed: int) -> str:
  if data_config.source == 'file':
    with open(data_config.path, encoding='utf-8') as f:
      return f.read()
  if data_config.source == 'embedded':
    return embedded_corpus(data_config.embedded_max_bytes)
  return synthetic_corpus(data_config.synthetic_tokens, seed)


@dataclasses.dataclass(frozen=True)
class Corpus:
  tokenizer: Tokenizer
  train_tokens: np.ndarray
  val_tokens: np.ndarray


def load_corpus(data_config, seed: int) -> Corpus:
  """Reads and tokenises the source; the last `val_fraction` of it is held out."""
  text = load_text(data_config, seed)
  tokenizer = Tokenizer.fit(data_config.tokenizer, text)
  tokens = tokenizer.encode(text)
  split = int(len(tokens) * (1 - data_config.val_fraction))
  min_len = data_config.seq_len + 2
  if split < min_len or len(tokens) - split < min_len:
    raise ValueError(
        f'data: the corpus has {len(tokens)} tokens, too few for a train/validation split with '
        f'windows of data.seq_len+1={data_config.seq_len + 1}; use a larger source or a shorter '
        'data.seq_len.')
  return Corpus(tokenizer, tokens[:split], tokens[split:])


def windows_dataset(tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                    process_index: int, process_count: int) -> grain.MapDataset:
  """This process's slice of every global batch: element s is an int32 [B/P, seq_len+1] array."""
  local_batch = global_batch // process_count
  starts = grain.MapDataset.range(len(tokens) - seq_len).shuffle(seed=seed).repeat(None)
  windows = starts.map(lambda start: tokens[start:start + seq_len + 1])
  batches = windows.batch(local_batch, drop_remainder=True)
  return batches[process_index::process_count]


def train_iterator(corpus: Corpus, data_config, seed: int) -> grain.DatasetIterator:
  """A checkpointable iterator over this process's training batches."""
  dataset = windows_dataset(corpus.train_tokens, data_config.seq_len,
                            data_config.global_batch_size, seed, jax.process_index(),
                            jax.process_count())
  return iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=4)))


def eval_batches(corpus: Corpus, data_config, seed: int, num_batches: int) -> list[np.ndarray]:
  """The same fixed held-out batches at every evaluation, so eval losses are comparable."""
  dataset = windows_dataset(corpus.val_tokens, data_config.seq_len,
                            data_config.global_batch_size, seed + 1, jax.process_index(),
                            jax.process_count())
  return [dataset[i] for i in range(num_batches)]


def to_global(local_batch: np.ndarray, sharding: jax.sharding.Sharding,
              global_batch: int) -> jax.Array:
  """Assembles the global batch from every process's local rows (one process: all of them)."""
  global_shape = (global_batch,) + local_batch.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local_batch, global_shape)
