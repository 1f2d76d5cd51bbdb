"""The data section: the source and its files, the tokenizer, the split, and the sequence
length against the model's positions (engine.validation calls `check_data`)."""

from __future__ import annotations

import os

from ml_collections import ConfigDict

from engine.config import SOURCES, TOKENIZERS
from engine.data import text_files
from engine.errors import ConfigError
from engine.validation.checks import choose, require_positive


def _check_data_file(path: str) -> None:
  """data.path must name a readable file (its UTF-8 and length are checked when it is read)."""
  fix = ('pass --config.data.path=PATH to a UTF-8 text file, or use '
         '--config.data.source=embedded.')
  if not path:
    raise ConfigError(f"data.path='' is not set, but data.source='file' reads it; {fix}")
  text_files.check_file(path, f'data.path={path!r}', fix)


def check_data(data: ConfigDict, model: ConfigDict, reads_text: bool = True) -> None:
  choose(data, 'source', 'data.source', SOURCES)
  choose(data, 'tokenizer', 'data.tokenizer', TOKENIZERS)
  if data.source == 'file' and reads_text:
    _check_data_file(data.path)
  subword = data.tokenizer in ('hf', 'sentencepiece')
  if subword and data.source != 'shards' and not os.path.isfile(data.tokenizer_path):
    raise ConfigError(
        f'data.tokenizer={data.tokenizer!r} reads data.tokenizer_path, but '
        f'{data.tokenizer_path!r} is not a file; pass --config.data.tokenizer_path=PATH '
        '(python -m engine.data.train_tokenizer makes a tokenizer.json from any text).')
  if data.source == 'shards' and not data.shards:
    raise ConfigError("data.source='shards' reads data.shards, which is empty; pass "
                      '--config.data.shards=DIR (an engine.data.prepare output; DIR:WEIGHT,... to '
                      'mix).')
  if data.path and data.source != 'file':
    raise ConfigError(
        f'data.path={data.path!r} is set but data.source={data.source!r} does not '
        'read files; add --config.data.source=file, or drop data.path.')
  require_positive(data, 'data', ['seq_len', 'global_batch_size', 'embedded_max_bytes',
                                  'synthetic_tokens'])
  if not 0.0 < data.val_fraction < 1.0:
    raise ConfigError(f'data.val_fraction={data.val_fraction} must lie in (0, 1).')
  if data.seq_len > model.max_len:
    fix = ('raise model.max_len or shorten data.seq_len' if not model.hf_architecture else
           "shorten data.seq_len (model.max_len is the checkpoint's max_position_embeddings)")
    raise ConfigError(
        f'data.seq_len={data.seq_len} exceeds model.max_len={model.max_len}; {fix}.')
