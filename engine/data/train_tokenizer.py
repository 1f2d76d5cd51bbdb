"""Trains a byte-level BPE tokenizer (Hugging Face `tokenizers`) on a corpus: a tokenizer.json
for `--config.data.tokenizer=hf` and `engine.data.prepare`, when you have none.

  python -m engine.data.train_tokenizer --input=embedded --vocab_size=4096 --out=/tmp/bpe.json
  python -m engine.data.train_tokenizer --input=../shared/data/tinyshakespeare.txt --vocab_size=2048 \
      --out=/tmp/shakespeare_bpe.json

Byte-level: every text encodes (no unknown token) and decodes back exactly. The one special
token, `<|endoftext|>`, separates documents.
"""

from __future__ import annotations

import os
import time

from absl import flags, logging

from engine.data import sources
from engine.errors import ConfigError
from engine.cli.command_line import run_command

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
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
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


def main():
  source = flags.DEFINE_string('input', 'embedded', 'A text file, a directory of them, or '
                               '"embedded" (the engine\'s built-in corpus).')
  vocab_size = flags.DEFINE_integer('vocab_size', 4096, 'Vocabulary size, special token included.')
  out = flags.DEFINE_string('out', None, 'Where to write the tokenizer.json.')
  overwrite = flags.DEFINE_bool('overwrite', False, 'Replace an existing --out file.')

  def run(argv):
    del argv
    if os.path.exists(out.value) and not os.path.isdir(out.value) and not overwrite.value:
      raise ConfigError(f'--out={out.value!r} already exists (shard sets prepared with it would '
                        'no longer match it); pass --overwrite to replace it, or another --out.')
    start = time.perf_counter()
    documents = sources.read_inputs([source.value])
    tokenizer = train(documents, vocab_size.value, out.value, exact=True)
    logging.info('Trained on %d documents (%.1f MB) in %.1f s', len(documents),
                 sum(map(len, documents)) / 1e6, time.perf_counter() - start)
    print(f'Wrote {out.value}: vocabulary {tokenizer.get_vocab_size()}')

  run_command(run, 'engine.data.train_tokenizer', required=('out',))


if __name__ == '__main__':
  main()
