"""A byte-level BPE tokenizer (Hugging Face `tokenizers`) trained on documents and written as a
tokenizer.json: the library of `python -m engine.data.train_tokenizer` (engine/data/
train_tokenizer.py, the command).

Byte-level: every text encodes (no unknown token) and decodes back exactly. The one special
token, END_OF_TEXT, separates documents.
"""

from __future__ import annotations

import os

from engine.errors import ConfigError

END_OF_TEXT = '<|endoftext|>'


def check_out(out: str) -> None:
  """Refuses an --out that cannot take the file, before the training."""
  if os.path.isdir(out):
    raise ConfigError(f'--out={out!r} is a directory; pass a file path, e.g. '
                      f'--out={os.path.join(out, "tokenizer.json")}.')
  parent = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(parent):
    raise ConfigError(f'--out={out!r}: {parent} is not a directory; create it or pass another '
                      'path.')


def train(texts, vocab_size: int, out: str, exact: bool = False):
  """Trains on an iterable of documents and writes `out`; returns the tokenizer. `exact` (the
  command's): refuse, writing nothing, a text too small for `vocab_size` tokens (the trainer
  stops when no pair is left to merge)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers
  if vocab_size < 257:
    raise ConfigError(f'--vocab_size={vocab_size}: a byte-level BPE needs more than the 256 '
                      'bytes and the end-of-text token; use at least 257 (typical: 4096-65536).')
  check_out(out)
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(texts, trainer)
  if exact and tokenizer.get_vocab_size() < vocab_size:
    raise ConfigError(f'--vocab_size={vocab_size}: the input yields only '
                      f'{tokenizer.get_vocab_size()} tokens; pass more text or a --vocab_size of '
                      f'at most {tokenizer.get_vocab_size()}.')
  tokenizer.save(f'{out}.tmp')  # Whole or not at all: a failed write leaves the old file.
  os.replace(f'{out}.tmp', out)
  return tokenizer
