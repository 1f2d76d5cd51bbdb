"""Trains a byte-level BPE tokenizer (Hugging Face `tokenizers`) on a corpus: a tokenizer.json
for `--config.data.tokenizer=hf` and `engine.data.prepare`, when you have none.

  python -m engine.data.train_tokenizer --input=embedded --vocab_size=4096 --out=/tmp/bpe.json
  python -m engine.data.train_tokenizer --input=experiments/data/tinyshakespeare.txt --vocab_size=2048 \
      --out=/tmp/shakespeare_bpe.json

Byte-level: every text encodes (no unknown token) and decodes back exactly. The one special
token, `<|endoftext|>`, separates documents.
"""

from __future__ import annotations

import os
import time

from absl import flags, logging

from engine.data import sources
from engine.data.bpe_trainer import train
from engine.errors import ConfigError
from engine.cli.command_line import run_command

_SOURCE = flags.DEFINE_string('input', 'embedded', 'A text file, a JSON lines or Parquet file, a '
                              'datasets directory, a directory of them, or "embedded" (the '
                              'engine\'s built-in corpus).')
_TEXT_FIELD = flags.DEFINE_string('text_field', 'text', 'The field of JSON lines, Parquet and '
                                  'datasets records that holds the text.')
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', 4096, 'Vocabulary size, special token included.')
_OUT = flags.DEFINE_string('out', None, 'Where to write the tokenizer.json.')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace an existing --out file.')


def main(argv):
  del argv
  if os.path.exists(_OUT.value) and not os.path.isdir(_OUT.value) and not _OVERWRITE.value:
    raise ConfigError(f'--out={_OUT.value!r} already exists (shard sets prepared with it would '
                      'no longer match it); pass --overwrite to replace it, or another --out.')
  start = time.perf_counter()
  documents = sources.read_inputs([_SOURCE.value], _TEXT_FIELD.value)
  tokenizer = train(documents, _VOCAB_SIZE.value, _OUT.value, exact=True)
  logging.info('Trained on %d documents (%.1f MB) in %.1f s', len(documents),
               sum(map(len, documents)) / 1e6, time.perf_counter() - start)
  print(f'Wrote {_OUT.value}: vocabulary {tokenizer.get_vocab_size()}')


if __name__ == '__main__':
  run_command(main, 'engine.data.train_tokenizer', required=('out',))

