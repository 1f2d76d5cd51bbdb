"""Text sources: a UTF-8 file (or a directory of them), an embedded default corpus (the Python
standard library's own `.py` sources, present on every machine with Python), and a seeded
synthetic Markov text for tests.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np

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


def documents(source: str):
  """The documents of a text source, in order: `embedded` (each standard-library module), a
  UTF-8 text file (one document), or a directory (each file below it, in path order)."""
  if source == 'embedded':
    for path in _stdlib_modules():
      with open(path, encoding='utf-8', errors='replace') as f:
        yield f.read()
    return
  if os.path.isdir(source):
    paths = sorted(os.path.join(root, name) for root, dirs, names in os.walk(source)
                   for name in names if not name.startswith('.'))
  elif os.path.isfile(source):
    paths = [source]
  else:
    raise ConfigError(f'--input={source!r} is neither a file, a directory, nor "embedded"; pass '
                      'a text file or a directory of them.')
  for path in paths:
    yield text_files.read_text(path, f'--input={source!r}' if path == source else
                               f'{path!r} (under --input={source!r})')


def read_inputs(inputs: list[str]) -> list[str]:
  """The documents of every --input of the data commands; one without text is refused."""
  found = []
  for source in inputs:
    texts = list(documents(source))
    if not any(texts):
      what = ('holds no files' if not texts else
              'is empty' if os.path.isfile(source) else 'holds only empty files')
      raise ConfigError(f'--input={source!r} {what}: there is no text to tokenize; pass a file or '
                        'directory with text.')
    found.extend(texts)
  return found


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
