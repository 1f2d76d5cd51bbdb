"""Tokenizes text once into ArrayRecord shards (engine/data/shards.py) for `data.source=shards`.

  python -m engine.data.train_tokenizer --input=embedded --vocab_size=4096 --out=/tmp/bpe.json
  python -m engine.data.prepare --input=embedded --tokenizer=hf --tokenizer_path=/tmp/bpe.json \
      --out=/tmp/stdlib_shards
  python -m engine.main --config=experiments/tiny.py --config.data.source=shards \
      --config.data.shards=/tmp/stdlib_shards --workdir=/tmp/tiny_bpe

Inputs (--input, repeatable): text files, directories of them (every file, recursively, in name
order), or `embedded` (the standard library's modules). Each file is a document; a document
longer than `piece_bytes` (an argument of `prepare()`, 1 << 20 by default, counted in characters,
which are bytes for ASCII text; no flag sets it) is tokenized in pieces, each cut after the last
newline within that length, or at the length where there is none (subword merges never cross a
piece boundary). Pieces are tokenized by --processes worker processes (0, the default: one per
core), in order; each document is preceded by the tokenizer's beginning-of-text token and
followed by its end-of-text token, where it has them. --tokenizer is byte, hf or sentencepiece
(a character vocabulary is fitted to one corpus in memory, so it cannot write shards). A
progress line goes to the log, and the last line printed gives the tokens, documents, shards and
tokens/s.
"""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np
from absl import flags, logging

from engine.data import sources
from engine.data import shards
from engine.data import tokenizers as tokenizer_lib
from engine.config import ConfigError
from engine.cli import run_command

_TOKENIZER = None  # Each worker process's own.


def _load_tokenizer(kind: str, path: str) -> None:
  global _TOKENIZER
  _TOKENIZER = tokenizer_lib.load(kind, path)


def _encode(piece: str):
  return _TOKENIZER.encode(piece)


def pieces(documents, piece_bytes: int):
  """(text, starts_document, ends_document) pieces of every document, cut after a newline near
  piece_bytes."""
  for text in documents:
    start = 0
    while len(text) - start > piece_bytes:
      cut = text.rfind('\n', start, start + piece_bytes) + 1 or start + piece_bytes
      yield text[start:cut], start == 0, False
      start = cut
    yield text[start:], start == 0, True


def prepare(inputs: list[str], kind: str, path: str, out: str, processes: int = 0,
            record_tokens: int = 4096, records_per_shard: int = 1024,
            piece_bytes: int = 1 << 20) -> dict:
  """Writes the shard set for `inputs` to `out`; returns its metadata."""
  if kind == 'char':
    raise ConfigError('--tokenizer=char: a character vocabulary is fitted to one corpus in memory; '
                      'prepare shards with byte, hf or sentencepiece.')
  tokenizer = tokenizer_lib.load(kind, path)
  documents = [text for source in inputs for text in sources.documents(source)]
  total_bytes = sum(len(d.encode('utf-8')) for d in documents)
  writer = shards.Writer(out, tokenizer.vocab_size, record_tokens, records_per_shard)
  processes = processes or os.cpu_count() or 1
  start, last_report, done_bytes, tokens = time.perf_counter(), 0.0, 0, 0
  bos, eos = tokenizer.bos_id, tokenizer.eos_id
  work = list(pieces(documents, piece_bytes))
  with multiprocessing.get_context('spawn').Pool(processes, _load_tokenizer, (kind, path)) as pool:
    for (text, starts, ends), ids in zip(work, pool.imap(_encode, (w[0] for w in work),
                                                          chunksize=4)):
      ids = np.concatenate([[bos] if starts and bos is not None else [], ids,
                            [eos] if ends and eos is not None else []]).astype(np.int64)
      writer.add(ids)
      tokens += len(ids)
      done_bytes += len(text.encode('utf-8'))
      if time.perf_counter() - last_report > 2:
        last_report = time.perf_counter()
        elapsed = last_report - start
        logging.info('Tokenized %.1f of %.1f MB: %d tokens, %.0f tokens/s', done_bytes / 1e6,
                     total_bytes / 1e6, tokens, tokens / elapsed)
  seconds = time.perf_counter() - start
  meta = writer.close({
      'tokenizer': {'kind': kind, 'path': os.path.abspath(path) if path else '',
                    'vocab_size': tokenizer.vocab_size, 'eos_id': eos, 'bos_id': bos},
      'num_documents': len(documents), 'input_bytes': total_bytes, 'inputs': inputs,
      'seconds': seconds})
  logging.info('Wrote %d tokens in %d shards to %s: %.0f tokens/s with %d processes',
               meta['num_tokens'], len(meta['shards']), out, meta['num_tokens'] / seconds,
               processes)
  return meta


def main():
  inputs = flags.DEFINE_multi_string('input', None, 'Text file, directory, or "embedded"; '
                                     'repeatable.')
  kind = flags.DEFINE_enum('tokenizer', 'hf', ['byte', 'hf', 'sentencepiece'], 'Tokenizer kind.')
  path = flags.DEFINE_string('tokenizer_path', '', 'tokenizer.json (hf) or .model file.')
  out = flags.DEFINE_string('out', None, 'Directory to write the shards and meta.json to.')
  processes = flags.DEFINE_integer('processes', 0, 'Tokenizing processes (0: one per core).')
  record_tokens = flags.DEFINE_integer('record_tokens', 4096, 'Tokens per record.')
  records_per_shard = flags.DEFINE_integer('records_per_shard', 1024, 'Records per shard file.')

  def run(argv):
    del argv
    meta = prepare(inputs.value, kind.value, path.value, out.value, processes.value,
                   record_tokens.value, records_per_shard.value)
    print(f'{out.value}: {meta["num_tokens"]} tokens from {meta["num_documents"]} documents in '
          f'{len(meta["shards"])} shards, {meta["num_tokens"] / meta["seconds"]:,.0f} tokens/s')

  run_command(run, 'engine.data.prepare', required=('input', 'out'))


if __name__ == '__main__':
  main()
