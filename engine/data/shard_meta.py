"""A shard set's meta.json, checked against itself and against the run before anything is read.

On open (`read_meta`): the JSON and its fields and types; the counts (num_tokens is the sum of the
shards' tokens; every record but the stream's last holds record_tokens tokens); the dtype for the
vocabulary; each shard file present, inside the set, and of the recorded size; the recorded largest
id below the vocabulary. Against the run (`check_tokenizer`): the tokenizer kind is data.tokenizer,
and its file (data.tokenizer_path, else the one recorded) is the one the set was written with: the
same SHA-256 where meta.json records it (sets written by older versions of engine.data.prepare lack
it), the same vocabulary and end- / beginning-of-text ids, and the same text decoded from the
set's first record (`decoded_sha256`, which only the tokenizer that wrote the ids reproduces: ids
of another tokenizer under a copied or edited meta.json decode to other text; older sets lack it).
Each file's SHA-256 and record count
are checked when the reader first opens it, and every record's ids as it is read
(engine/data/shards.py). Every mismatch is one ConfigError naming the file and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import numpy as np

from engine.data import manifest_paths as paths
from engine.errors import ConfigError
from engine.models import documents

FORMAT = 'engine-token-shards/1'
META = 'meta.json'
PREPARE = 'rerun python -m engine.data.prepare to write the set again'
FILE_KINDS = ('hf', 'sentencepiece')
_SHA256 = re.compile(r'^[0-9a-f]{64}$')


def _fail(where: str, problem: str, fix: str = PREPARE):
  raise ConfigError(f'data.shards: {where} {problem}; {fix}.')


def _is_int(value, low: int = 0) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _load(directory: str) -> dict:
  path = os.path.join(directory, META)
  if not os.path.isdir(directory):
    _fail(repr(directory), 'is not a directory', 'pass an engine.data.prepare output directory')
  if not os.path.isfile(path):
    raise ConfigError(f'data.shards: {directory!r} holds no {META}; write shards there with '
                      'python -m engine.data.prepare --out=DIR.')
  try:
    with open(path, 'rb') as f:
      meta = json.loads(f.read().decode('utf-8'))
  except (ValueError, UnicodeDecodeError) as e:
    _fail(path, f'is not JSON ({str(e).splitlines()[0]})')
  if not isinstance(meta, dict):
    _fail(path, f'holds a JSON {type(meta).__name__}, not an object')
  if meta.get('format') != FORMAT:
    raise ConfigError(f'data.shards: {path} is format {meta.get("format")!r}, not {FORMAT!r}.')
  return meta


def _invalid(entries: dict, key: str) -> str:
  if key not in entries:
    return f'lacks {key!r}'
  return f'has an invalid {key!r} ({entries[key]!r:.60})'


def _check_fields(meta: dict, path: str) -> None:
  """Every field the reader relies on, present and of its type."""
  checks = {'dtype': lambda v: v in ('uint16', 'uint32'), 'record_tokens': lambda v: _is_int(v, 1),
            'num_tokens': _is_int, 'tokenizer': lambda v: isinstance(v, dict),
            'shards': lambda v: isinstance(v, list) and v and all(isinstance(s, dict) for s in v)}
  for key, valid in checks.items():
    if not valid(meta.get(key)):
      _fail(path, _invalid(meta, key))
  for i, shard in enumerate(meta['shards']):
    for key, valid in (('records', lambda v: _is_int(v, 1)), ('tokens', lambda v: _is_int(v, 1)),
                       ('sha256', lambda v: isinstance(v, str) and _SHA256.match(v))):
      if not valid(shard.get(key)):
        _fail(path, _invalid(shard, key) + f' for shard {i}')
    for key in ('bytes', 'max_id'):  # Older sets lack them.
      if key in shard and not _is_int(shard[key]):
        _fail(path, f'has an invalid {key!r} for shard {i} ({shard[key]!r:.60})')
  tokenizer = meta['tokenizer']
  kind, vocab = tokenizer.get('kind'), tokenizer.get('vocab_size')
  if kind not in ('byte',) + FILE_KINDS or not _is_int(vocab, 1) or not isinstance(
      tokenizer.get('path', ''), str):
    _fail(path, f'records no valid tokenizer (kind {kind!r}, vocab_size {vocab!r})')
  if kind == 'byte' and vocab != 256:
    _fail(path, f'records the byte tokenizer with vocab_size {vocab}, not 256')
  for key in ('eos_id', 'bos_id'):
    if tokenizer.get(key) is not None and not (_is_int(tokenizer[key]) and tokenizer[key] < vocab):
      _fail(path, f'records tokenizer {key} {tokenizer[key]!r}, not an id below {vocab}')


def _check_counts(meta: dict, path: str) -> None:
  """The counts against each other: the reader finds record k at token k * record_tokens."""
  shard_list, record_tokens = meta['shards'], meta['record_tokens']
  total = sum(s['tokens'] for s in shard_list)
  if meta['num_tokens'] != total:
    _fail(path, f'records num_tokens={meta["num_tokens"]}, but its shards hold {total} tokens')
  for i, shard in enumerate(shard_list):
    full = shard['records'] * record_tokens
    last = i == len(shard_list) - 1
    if shard['tokens'] > full or shard['tokens'] <= full - record_tokens or (
        not last and shard['tokens'] != full):
      _fail(path, f'records {shard["tokens"]} tokens in {shard["records"]} records for shard '
            f'{i} ({shard.get("file")!r}), which record_tokens={record_tokens} does not allow')
  vocab = meta['tokenizer']['vocab_size']
  dtype = 'uint16' if vocab <= 2**16 and 'chat' not in meta else 'uint32'
  if meta['dtype'] != dtype:
    _fail(path, f'records dtype {meta["dtype"]} for a vocabulary of {vocab} (prepare writes '
          f'{dtype}{" for conversations" if "chat" in meta else ""})')
  for shard in shard_list:
    if shard.get('max_id', 0) >= vocab:
      _fail(path, f'records token id {shard["max_id"]} in {shard.get("file")!r}, outside the '
            f'vocabulary of {vocab}')


def _check_files(meta: dict, directory: str, path: str) -> list[str]:
  """Each shard file's path: inside the set, present, of the recorded size."""
  files = []
  for shard in meta['shards']:
    file = paths.inside(directory, shard.get('file'), f'data.shards: {path}')
    if not os.path.isfile(file):
      _fail(file, f'listed in {META} is missing')
    if 'bytes' in shard and os.path.getsize(file) != shard['bytes']:
      _fail(file, f'holds {os.path.getsize(file)} bytes, but {META} records {shard["bytes"]} '
            '(a truncated or replaced file)')
    files.append(file)
  return files


def read_meta(directory: str) -> tuple[dict, list[str]]:
  """The set's meta.json, checked (module docstring), and its shard files' paths."""
  meta = _load(directory)
  path = os.path.join(directory, META)
  _check_fields(meta, path)
  _check_counts(meta, path)
  return meta, _check_files(meta, directory, path)


def decoded_sha256(tokenizer, first_record) -> str:
  """The SHA-256 of the text `first_record`'s ids (flags stripped) decode to with `tokenizer`."""
  text = tokenizer.decode(documents.token_ids(np.asarray(first_record, np.int64)))
  return hashlib.sha256(text.encode('utf-8', errors='surrogatepass')).hexdigest()


def check_tokenizer(meta: dict, directory: str, data_config, sha256, first_record) -> str:
  """That the run names the tokenizer the set was written with; returns the file that decodes
  (data.tokenizer_path, else the recorded one; '' for bytes). `first_record`: a function reading
  the set's first record, for the decoded text's check."""
  from engine.data import tokenizers  # pylint: disable=g-import-not-at-top
  recorded = meta['tokenizer']
  kind, recorded_path = recorded['kind'], recorded.get('path', '')
  if data_config.tokenizer != kind:
    flags = f'--config.data.tokenizer={kind}' + (
        f' (its file: {recorded_path})' if recorded_path else '')
    _fail(repr(directory), f'was written with the {kind} tokenizer, but data.tokenizer='
          f'{data_config.tokenizer!r}', f'pass {flags}, or rerun engine.data.prepare with the '
          "run's tokenizer")
  if kind not in FILE_KINDS:
    _check_decoded(recorded, tokenizers.load(kind, ''), directory, first_record, 'the byte '
                   'tokenizer')
    return ''
  file = data_config.tokenizer_path or recorded_path
  named = 'data.tokenizer_path' if data_config.tokenizer_path else f'its {META}'
  if not os.path.isfile(file):
    _fail(repr(directory), f"names tokenizer file {file!r} ({named}), which is not a file",
          'pass --config.data.tokenizer_path=the file the set was prepared with')
  mismatch = 'is not the tokenizer {} was written with ({}); pass the file it was prepared with, ' \
             'or rerun engine.data.prepare with this one'
  if 'sha256' in recorded and sha256(file) != recorded['sha256']:
    raise ConfigError(f'data.shards: tokenizer {file} ({named}) ' + mismatch.format(
        repr(directory), f'its SHA-256 differs from the one {META} records') + '.')
  loaded = tokenizers.load(kind, file)
  found = (loaded.vocab_size, loaded.eos_id, loaded.bos_id)
  want = (recorded['vocab_size'], recorded.get('eos_id'), recorded.get('bos_id'))
  if found != want:
    raise ConfigError(f'data.shards: tokenizer {file} ({named}) ' + mismatch.format(
        repr(directory), f'vocabulary, end- and beginning-of-text ids {found}, {META}: {want}')
        + '.')
  _check_decoded(recorded, loaded, directory, first_record, f'tokenizer {file} ({named})')
  return file


def _check_decoded(recorded: dict, tokenizer, directory: str, first_record, which: str) -> None:
  if 'decoded_sha256' in recorded and decoded_sha256(
      tokenizer, first_record()) != recorded['decoded_sha256']:
    _fail(repr(directory), f'holds ids that {which} does not decode to the text they were '
          f'written from (the first record\'s decoded SHA-256 differs from the one {META} '
          'records): the set was written with another tokenizer than its meta.json names',
          f'{PREPARE} with the tokenizer to train with')
