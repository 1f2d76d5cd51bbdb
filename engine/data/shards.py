"""Pre-tokenized shards: a token stream in ArrayRecord files, written by engine.data.prepare and
streamed by `data.source=shards`.

A shard set is a directory:
  meta.json              format, tokenizer (kind, path, vocabulary, end-of-text id), dtype,
                         tokens per record, counts, and every shard file's records, tokens and
                         SHA-256;
  tokens-00000.arrayrecord, ...   records of `record_tokens` tokens each (the last may be
                         shorter), uint16 when the vocabulary fits, else uint32.
The stream is the documents' tokens in order, each document between the tokenizer's
beginning- and end-of-text tokens (where it has them). Training reads it packed: window i is tokens [i L, i L + L + 1)
for sequence length L, documents running into each other across the separator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from engine import paths
from engine.config import ConfigError

FORMAT = 'engine-token-shards/1'
META = 'meta.json'


class Writer:
  """Appends tokens; cuts them into records and records into shard files."""

  def __init__(self, directory: str, vocab_size: int, record_tokens: int = 4096,
               records_per_shard: int = 1024):
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self._module = array_record_module
    self.directory, self.record_tokens = directory, record_tokens
    self.records_per_shard = records_per_shard
    self.dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    self.shards: list[dict] = []
    self._pending = np.zeros(0, self.dtype)
    self._writer = None
    os.makedirs(directory, exist_ok=True)

  def add(self, tokens: np.ndarray) -> None:
    self._pending = np.concatenate([self._pending, tokens.astype(self.dtype)])
    while len(self._pending) >= self.record_tokens:
      self._write(self._pending[:self.record_tokens])
      self._pending = self._pending[self.record_tokens:]

  def _write(self, record: np.ndarray) -> None:
    if self._writer is None or self.shards[-1]['records'] == self.records_per_shard:
      self._close_shard()
      name = f'tokens-{len(self.shards):05d}.arrayrecord'
      self._writer = self._module.ArrayRecordWriter(os.path.join(self.directory, name),
                                                    'group_size:1')
      self.shards.append({'file': name, 'records': 0, 'tokens': 0})
    self._writer.write(record.tobytes())
    self.shards[-1]['records'] += 1
    self.shards[-1]['tokens'] += len(record)

  def _close_shard(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
      shard = self.shards[-1]
      shard['sha256'] = sha256(os.path.join(self.directory, shard['file']))

  def close(self, meta: dict) -> dict:
    """Flushes the last record and shard and writes meta.json (with `meta`'s entries)."""
    if len(self._pending):
      self._write(self._pending)
    self._close_shard()
    meta = dict(meta, format=FORMAT, dtype=np.dtype(self.dtype).name,
                record_tokens=self.record_tokens, shards=self.shards,
                num_tokens=sum(s['tokens'] for s in self.shards))
    with open(os.path.join(self.directory, META + '.tmp'), 'w') as f:
      json.dump(meta, f, indent=1)
    os.replace(os.path.join(self.directory, META + '.tmp'), os.path.join(self.directory, META))
    return meta


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def read_meta(directory: str) -> dict:
  path = os.path.join(directory, META)
  if not os.path.isfile(path):
    raise ConfigError(f'data.shards: {directory!r} holds no {META}; write shards there with '
                      'python -m engine.data.prepare --out=DIR.')
  with open(path) as f:
    meta = json.load(f)
  if meta.get('format') != FORMAT:
    raise ConfigError(f'data.shards: {path} is format {meta.get("format")!r}, not {FORMAT!r}.')
  for shard in meta['shards']:
    file = paths.inside(directory, shard.get('file'), f'data.shards: {path}')
    if not os.path.isfile(file):
      raise ConfigError(f'data.shards: {file} listed in {META} is missing; rerun engine.data.prepare.')
  return meta


class TokenStream:
  """Random access to a shard set's token stream."""

  def __init__(self, directory: str):
    import grain  # pylint: disable=g-import-not-at-top
    self.directory = directory
    self.meta = read_meta(directory)
    self.record_tokens = self.meta['record_tokens']
    self.dtype = np.dtype(self.meta['dtype'])
    self.num_tokens = self.meta['num_tokens']
    self._records = grain.sources.ArrayRecordDataSource(
        [paths.inside(directory, s['file'], META) for s in self.meta['shards']])

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the stream, as int32."""
    first, last = start // self.record_tokens, (stop - 1) // self.record_tokens
    parts = [np.frombuffer(self._records[i], self.dtype) for i in range(first, last + 1)]
    offset = start - first * self.record_tokens
    return np.concatenate(parts)[offset:offset + stop - start].astype(np.int32)


@dataclasses.dataclass
class PackedWindows:
  """Window i of a stream: tokens [i L, i L + L + 1) (L = seq_len), a grain data source."""
  stream: TokenStream
  seq_len: int

  def __len__(self) -> int:
    return max(0, (self.stream.num_tokens - 1) // self.seq_len)

  def __getitem__(self, index: int) -> np.ndarray:
    start = int(index) * self.seq_len
    return self.stream.tokens(start, start + self.seq_len + 1)


def parse_sets(spec: str) -> list[tuple[str, float]]:
  """'DIR' or 'DIR:WEIGHT,DIR:WEIGHT' -> [(dir, weight)], weights normalised to sum to 1."""
  sets = []
  for part in filter(None, (p.strip() for p in spec.split(','))):
    directory, _, weight = part.rpartition(':') if ':' in part else (part, '', '1')
    try:
      value = float(weight)
    except ValueError:
      directory, value = part, 1.0
    if value <= 0:
      raise ConfigError(f'data.shards={spec!r}: weight {weight} of {directory!r} must be > 0.')
    sets.append((directory, value))
  if not sets:
    raise ConfigError("data.source='shards' reads data.shards, which is empty; pass "
                      '--config.data.shards=DIR (or DIR:WEIGHT,DIR:WEIGHT to mix).')
  total = sum(w for _, w in sets)
  return [(d, w / total) for d, w in sets]
