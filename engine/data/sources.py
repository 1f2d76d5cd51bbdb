"""Text sources: a UTF-8 file, a file of records (JSON lines, Parquet) or a `datasets` directory
(engine/data/record_files.py), a directory of any of them, an embedded default corpus (the Python
standard library's own `.py` sources, present on every machine with Python), and a seeded
synthetic Markov text for tests.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

from engine.data import record_files
from engine.data import text_files
from engine.errors import ConfigError


def _stdlib_modules() -> list[str]:
  return sorted(glob.glob(os.path.join(sysconfig.get_paths()['stdlib'], '*.py')))


def embedded_corpus(max_bytes: int) -> str:
  """The standard library's top-level `.py` files, in name order: real text on every machine."""
  parts, size = [], 0
  for path in _stdlib_modules():
    with open(path, encoding='utf-8', errors='replace') as f:
      parts.append(f'# ---- {os.path.basename(path)}\n' + f.read())
    size += len(parts[-1])
    if size >= max_bytes:
      break
  return ''.join(parts)[:max_bytes]


def _paths(source: str) -> list[str]:
  """A directory's inputs, in path order: its files, and its `datasets` directories whole."""
  found = []
  for root, dirs, names in os.walk(source):
    datasets = [n for n in dirs if record_files.is_datasets_directory(os.path.join(root, n))]
    found.extend(os.path.join(root, name) for name in datasets)
    dirs[:] = [n for n in dirs if n not in datasets]
    found.extend(os.path.join(root, name) for name in names if not name.startswith('.'))
  return sorted(found)


def _checked_paths(source: str, text_field: str, flag: str = '--text_field') -> list[str]:
  """The files (or `datasets` directories) of one --input, each record file's field (which
  `flag` names) checked."""
  if source == 'embedded':
    return _stdlib_modules()
  if record_files.is_datasets_directory(source):
    paths = [source]
  elif os.path.isdir(source):
    paths = _paths(source)
  elif os.path.isfile(source):
    paths = [source]
  else:
    raise ConfigError(f'--input={source!r} is neither a file, a directory, nor "embedded"; pass '
                      'a text file or a directory of them.')
  for path in paths:
    kind = record_files.kind_of(path)
    if kind:
      record_files.check(path, kind, text_field, _what(source, path), flag)
  return paths


def _what(source: str, path: str) -> str:
  return f'--input={source!r}' if path == source else f'{path!r} (under --input={source!r})'


def documents(source: str, text_field: str = 'text'):
  """The documents of a text source, in order: `embedded` (each standard-library module), a
  UTF-8 text file (one document), a file of records (JSON lines, Parquet) or a `datasets`
  directory (each record's `text_field` one document, engine/data/record_files.py), or a
  directory (each of those below it, in path order)."""
  return _documents(source, _checked_paths(source, text_field), text_field)


def _documents(source: str, paths: list[str], text_field: str):
  """The documents of `source`'s files (_checked_paths')."""
  if source == 'embedded':
    for path in paths:
      with open(path, encoding='utf-8', errors='replace') as f:
        yield f.read()
    return
  for path in paths:
    kind = record_files.kind_of(path)
    if kind:
      yield from record_files.texts(path, kind, text_field, _what(source, path), '--text_field')
    else:
      yield text_files.read_text(path, _what(source, path))


def _refuse_empty(source: str, found_files: bool) -> None:
  what = ('holds no files' if not found_files else
          'is empty' if os.path.isfile(source) else 'holds only empty files and records')
  raise ConfigError(f'--input={source!r} {what}: there is no text to tokenize; pass a file or '
                    'directory with text.')


def stream_inputs(inputs: list[str], text_field: str = 'text'):
  """The documents of every --input of the data commands, streamed. Every input is checked at
  the call (it exists, holds files, its record files have the field); one that turns out to hold
  no text is refused when its documents end."""
  paths = {source: _checked_paths(source, text_field) for source in inputs}
  for source in inputs:
    if not paths[source]:
      _refuse_empty(source, found_files=False)

  def stream():
    for source in inputs:
      any_text = False
      for text in _documents(source, paths[source], text_field):
        any_text = any_text or bool(text)
        yield text
      if not any_text:
        _refuse_empty(source, found_files=True)
  return stream()


def stream_conversations(inputs: list[str], messages_field: str):
  """(what, messages) of every record of every --input, streamed; every input is checked at the
  call: only record files hold conversations."""
  paths = []
  for source in inputs:
    if source == 'embedded':
      raise ConfigError("--input='embedded' is the embedded text corpus, but --messages_field "
                        'reads conversations from records; pass JSON lines, Parquet or datasets '
                        'directories.')
    found = _checked_paths(source, messages_field, '--messages_field')
    if not found:
      _refuse_empty(source, found_files=False)
    for path in found:
      if record_files.kind_of(path) is None:
        raise ConfigError(f'{_what(source, path)} is a text file, but --messages_field reads '
                          'conversations from records; pass JSON lines, Parquet or datasets '
                          'directories.')
    paths.extend((source, path) for path in found)

  def stream():
    for source, path in paths:
      what = _what(source, path)
      for number, messages in record_files.conversations(path, record_files.kind_of(path),
                                                         messages_field, what):
        yield f'{what}, record {number}', messages
  return stream()


def read_inputs(inputs: list[str], text_field: str = 'text') -> list[str]:
  """stream_inputs' documents, in one list."""
  return list(stream_inputs(inputs, text_field))


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


def read_text_file(path: str) -> str:
  """The file's text; raises ConfigError naming data.path (engine/data/text_files.py)."""
  return text_files.read_text(path, f'data.path={path!r}')


def load_text(data_config, seed: int) -> str:
  if data_config.source == 'file':
    return read_text_file(data_config.path)
  if data_config.source == 'embedded':
    return embedded_corpus(data_config.embedded_max_bytes)
  return synthetic_corpus(data_config.synthetic_tokens, seed)
