"""Pre-tokenized shards: a token stream in ArrayRecord files, written by engine.data.prepare and
streamed by `data.source=shards`.

A shard set is a directory:
  meta.json              format, tokenizer (kind, path, vocabulary, end- and beginning-of-text
                         ids, the file's SHA-256), dtype, tokens per record, counts, and every
                         shard file's records, tokens, bytes, largest id and SHA-256; written
                         last, so a directory without it is no set;
  tokens-00000.arrayrecord, ...   records of `record_tokens` tokens each (the last may be
                         shorter), uint16 when the vocabulary fits, else uint32
                         (a set of conversations: uint32, its ids flagged).
The stream is the documents' tokens in order, each document between the tokenizer's
beginning- and end-of-text tokens (where it has them). Training reads it packed: window i is
tokens [i L, i L + L + 1) for sequence length L, documents running into each other across the
separator. A set is checked against its meta.json on open (engine/data/shard_meta.py), each
file's SHA-256 and record count when it is first read, and each record's length and ids as it
is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading

import numpy as np

from engine.errors import ConfigError
from engine.models import documents
from engine.data.shard_meta import FORMAT, META, PREPARE, read_meta


class Writer:
  """Appends tokens; cuts them into records and records into shard files."""

  def __init__(self, directory: str, vocab_size: int, record_tokens: int = 4096,
               records_per_shard: int = 1024, flagged: bool = False):
    """`flagged`: the ids carry engine/models/documents.py's flags (a set of conversations),
    so they are stored as uint32 and the recorded largest id is of the ids without them."""
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    self._module = array_record_module
    self.directory, self.record_tokens = directory, record_tokens
    self.records_per_shard = records_per_shard
    self.dtype = np.uint16 if vocab_size <= 2**16 and not flagged else np.uint32
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
      self.shards.append({'file': name, 'records': 0, 'tokens': 0, 'max_id': 0})
    self._writer.write(record.tobytes())
    shard = self.shards[-1]
    shard['records'] += 1
    shard['tokens'] += len(record)
    ids = documents.token_ids(record.astype(np.int64))
    shard['max_id'] = max(shard['max_id'], int(ids.max()))

  def _close_shard(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
      shard = self.shards[-1]
      path = os.path.join(self.directory, shard['file'])
      shard['sha256'], shard['bytes'] = sha256(path), os.path.getsize(path)

  def close(self, meta: dict) -> dict:
    """Flushes the last record and shard and writes meta.json (with `meta`'s entries), last:
    a directory without it is no shard set."""
    if len(self._pending):
      self._write(self._pending)
    self._close_shard()
    meta = dict(meta, format=FORMAT, dtype=np.dtype(self.dtype).name,
                record_tokens=self.record_tokens, shards=self.shards,
                num_tokens=sum(s['tokens'] for s in self.shards))
    write_meta(self.directory, meta)
    return meta


def write_meta(directory: str, meta: dict) -> None:
  """DIRECTORY/meta.json, whole or not at all."""
  with open(os.path.join(directory, META + '.tmp'), 'w') as f:
    json.dump(meta, f, indent=1)
  os.replace(os.path.join(directory, META + '.tmp'), os.path.join(directory, META))


def sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


class Records:
  """The records of a set's shard files in order. A file is opened on its first read, after
  its SHA-256 and record count are checked against meta.json (once per file and process: the
  cost of hashing is spread over the run, not paid for every file at open)."""

  def __init__(self, meta: dict, files: list[str]):
    self.files, self._shards = files, meta['shards']
    self._ends = np.cumsum([s['records'] for s in self._shards])
    self._readers = [None] * len(files)
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self._ends[-1])

  def locate(self, index: int) -> tuple[int, int]:
    """(file, record within the file) of record `index`."""
    shard = int(np.searchsorted(self._ends, index, side='right'))
    return shard, index - (int(self._ends[shard - 1]) if shard else 0)

  def __getitem__(self, index: int) -> bytes:
    shard, position = self.locate(index)
    if self._readers[shard] is None:
      with self._lock:
        if self._readers[shard] is None:
          self._readers[shard] = self._open(shard)
    return self._readers[shard].read([position])[0]

  def _open(self, shard: int):
    from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
    file, recorded = self.files[shard], self._shards[shard]
    if sha256(file) != recorded['sha256']:
      raise ConfigError(f'data.shards: {file} does not match the SHA-256 that {META} records '
                        f'for it (a damaged or replaced file); {PREPARE}.')
    try:
      reader = array_record_module.ArrayRecordReader(file, 'readahead_buffer_size:0',
                                                      file_reader_buffer_size=32768)
    except Exception as e:  # The library raises its own types for unreadable files.
      raise ConfigError(f'data.shards: {file} is not a readable ArrayRecord file '
                        f'({str(e).splitlines()[0] if str(e) else type(e).__name__}); '
                        f'{PREPARE}.') from e
    if reader.num_records() != recorded['records']:
      raise ConfigError(f'data.shards: {file} holds {reader.num_records()} records, but {META} '
                        f'records {recorded["records"]}; {PREPARE}.')
    return reader


class TokenStream:
  """Random access to a shard set's token stream, checked as it is read (shard_meta.py)."""

  def __init__(self, directory: str):
    self.directory = directory
    self.meta, files = read_meta(directory)
    self.record_tokens = self.meta['record_tokens']
    self.dtype = np.dtype(self.meta['dtype'])
    self.num_tokens = self.meta['num_tokens']
    self.vocab_size = self.meta['tokenizer']['vocab_size']
    self._records = Records(self.meta, files)

  @property
  def identity(self) -> str:
    """The set's content as one SHA-256: its shards' digests and layout. A set written again
    from the same text with the same tokenizer keeps it; any other set has another."""
    content = [self.meta['dtype'], self.record_tokens,
               [(s['sha256'], s['records'], s['tokens']) for s in self.meta['shards']]]
    return hashlib.sha256(json.dumps(content).encode()).hexdigest()

  def record(self, index: int) -> np.ndarray:
    """Record `index` of the stream, its length and ids checked."""
    raw = self._records[index]
    want = min(self.record_tokens, self.num_tokens - index * self.record_tokens)
    ids = np.frombuffer(raw, self.dtype) if len(raw) % self.dtype.itemsize == 0 else None
    largest = (0 if ids is None or not len(ids) else
               int(documents.token_ids(ids.astype(np.int64)).max()) if 'chat' in self.meta else
               int(ids.max()))
    if ids is None or len(ids) != want or largest >= self.vocab_size:
      shard, position = self._records.locate(index)
      found = (f'{len(raw)} bytes, not {want} {self.dtype.name} tokens'
               if ids is None or len(ids) != want else
               f'token id {int(ids.max())}, outside the vocabulary of {self.vocab_size}')
      raise ConfigError(f'data.shards: record {position} of {self._records.files[shard]} holds '
                        f'{found} ({META}); {PREPARE}.')
    return ids

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the stream, as int32."""
    first, last = start // self.record_tokens, (stop - 1) // self.record_tokens
    parts = [self.record(i) for i in range(first, last + 1)]
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
    if not math.isfinite(value) or value <= 0:
      raise ConfigError(f'data.shards={spec!r}: weight {weight} of {directory!r} must be a '
                        'finite number > 0; write DIR:WEIGHT, e.g. DIR:3.')
    sets.append((directory, value))
  if not sets:
    raise ConfigError("data.source='shards' reads data.shards, which is empty; pass "
                      '--config.data.shards=DIR (or DIR:WEIGHT,DIR:WEIGHT to mix).')
  total = sum(w for _, w in sets)
  return [(d, w / total) for d, w in sets]
