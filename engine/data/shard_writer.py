"""Writes a shard set (engine/data/shards.py) from text: the library of `python -m
engine.data.prepare` (engine/data/prepare.py, the command, whose docstring says what a set
holds).

`prepare` reads the inputs, cuts long documents into pieces at newlines (`pieces`), tokenizes
them in worker processes, in order, and writes the set into OUT.tmp-* beside `out`, renamed to
`out` once meta.json is written: a failure leaves no set. `check_arguments` refuses, before
anything is read or written, what cannot make one.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import shutil
import tempfile
import time

import numpy as np
from absl import logging

from engine.data import chat
from engine.data import sources
from engine.data import shard_meta
from engine.data import shards
from engine.data import tokenizers as tokenizer_lib
from engine.errors import ConfigError

_TOKENIZER = None  # Each worker process's own.
_CHAT = None  # With --messages_field: (ChatTemplate, tokenizers.Tokenizer), each worker's own.
_WINDOW_PIECES = 16  # Pieces in flight per tokenizing process.
# What a directory that holds a shard set, or an interrupted one, may hold.
_SHARD_FILE = re.compile(r'^(tokens-\d+\.arrayrecord|meta\.json(\.tmp)?)$')


def _load_tokenizer(kind: str, path: str, template_path: str = '') -> None:
  global _TOKENIZER, _CHAT
  _TOKENIZER, _CHAT = tokenizer_lib.load(kind, path), None
  if template_path:
    import tokenizers  # pylint: disable=g-import-not-at-top
    _CHAT = chat.ChatTemplate(template_path, path), tokenizers.Tokenizer.from_file(path)


def _encode(piece):
  """A text piece's ids; a conversation's ((what, messages)) flagged ids, separator included."""
  if _CHAT is None:
    return _TOKENIZER.encode(piece)
  what, messages = piece
  return chat.encode(*_CHAT, chat.messages_of(messages, what), _TOKENIZER.eos_id)


def _size(piece) -> int:
  """The bytes of text a piece holds (a conversation's: its messages' contents)."""
  if isinstance(piece, str):
    return len(piece.encode('utf-8'))
  return sum(len(str(m.get('content', '')).encode('utf-8')) for m in piece[1]
             if isinstance(m, dict))


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


def check_arguments(kind: str, path: str, out: str, processes: int, record_tokens: int,
                    records_per_shard: int, overwrite: bool = False) -> None:
  """Refuses, before anything is read or written, what cannot make a shard set."""
  if kind == 'char':
    raise ConfigError('--tokenizer=char: a character vocabulary is fitted to one corpus in memory; '
                      'prepare shards with byte, hf or sentencepiece.')
  if kind in shard_meta.FILE_KINDS and not os.path.isfile(path or ''):
    given = f'{path!r} is not a file' if path else 'none is given'
    raise ConfigError(
        f'--tokenizer={kind} reads --tokenizer_path, but {given}; pass ' + (
            '--tokenizer_path=tokenizer.json (python -m engine.data.train_tokenizer makes one '
            'from any text).' if kind == 'hf' else '--tokenizer_path=a SentencePiece .model file.'))
  for name, value, low in (('processes', processes, 0), ('record_tokens', record_tokens, 1),
                           ('records_per_shard', records_per_shard, 1)):
    if value < low:
      raise ConfigError(f'--{name}={value} must be >= {low}' +
                        (' (0: one per core).' if name == 'processes' else '.'))
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f'--out={out!r} is a file; pass a new directory for the shard set.')
  above = os.path.dirname(out)
  while not os.path.exists(above):
    above = os.path.dirname(above)
  if not os.path.isdir(above):
    raise ConfigError(f'--out={out!r} lies under {above!r}, which is a file; pass a new directory '
                      'for the shard set.')
  if os.path.isdir(out) and os.listdir(out):
    names = sorted(os.listdir(out))
    others = [n for n in names if not _SHARD_FILE.match(n)]
    if others:
      raise ConfigError(f'--out={out!r} holds other files ({others[0]!r}, ...); pass a new or '
                        'empty directory for the shard set.')
    if not overwrite:
      raise ConfigError(f'--out={out!r} already holds a shard set (or part of one); pass '
                        '--overwrite to replace it, or another --out.')


def _windows(work, size: int):
  """`work` in lists of `size` items: what is in flight at once, so memory stays bounded."""
  while window := list(itertools.islice(work, size)):
    yield window


def _tokenize(writer, work, kind: str, path: str, processes: int,
              template_path: str = '') -> tuple[int, int]:
  """Feeds every piece's ids, in order, to the writer (one process: no pool to start); returns
  the documents and the bytes of text tokenized. Pieces are read a window at a time, the next
  window tokenizing while this one's ids are written."""
  start, last_report, done_bytes, tokens, documents = time.perf_counter(), 0.0, 0, 0, 0
  _load_tokenizer(kind, path, template_path)
  # A conversation's ids are whole (its template writes any beginning-of-text token).
  bos, eos = (None, None) if template_path else (_TOKENIZER.bos_id, _TOKENIZER.eos_id)
  pool = (multiprocessing.get_context('spawn').Pool(processes, _load_tokenizer,
                                                    (kind, path, template_path))
          if processes > 1 else None)

  def submit(window):
    texts = [w[0] for w in window]
    return window, (pool.map_async(_encode, texts, chunksize=4) if pool else
                    list(map(_encode, texts)))

  def write(window, encoded):
    nonlocal done_bytes, tokens, documents, last_report
    for (text, starts, ends), ids in zip(window, encoded if pool is None else encoded.get()):
      ids = np.concatenate([[bos] if starts and bos is not None else [], ids,
                            [eos] if ends and eos is not None else []]).astype(np.int64)
      writer.add(ids)
      tokens += len(ids)
      documents += ends
      done_bytes += _size(text)
    if time.perf_counter() - last_report > 2:
      last_report = time.perf_counter()
      logging.info('Tokenized %.1f MB of text, %d documents: %d tokens, %.0f tokens/s',
                   done_bytes / 1e6, documents, tokens, tokens / (last_report - start))

  try:
    pending = None
    for window in _windows(work, _WINDOW_PIECES * processes):
      submitted = submit(window)
      if pending:
        write(*pending)
      pending = submitted
    if pending:
      write(*pending)
  finally:
    if pool:
      pool.terminate()
  return documents, done_bytes


def _check_chat(kind: str, path: str, tokenizer, chat_template: str) -> str:
  """The chat template's file, checked (it compiles) before anything is written."""
  if kind != 'hf':
    raise ConfigError(f'--messages_field renders conversations with a chat template, which '
                      f'--tokenizer={kind} has none of; pass --tokenizer=hf '
                      "--tokenizer_path=the model's tokenizer.json.")
  if tokenizer.eos_id is None:
    raise ConfigError(f'--tokenizer_path={path!r} has no end-of-text token to separate '
                      'conversations; pass a tokenizer with one.')
  template_path = chat.find_template(path, chat_template)
  chat.ChatTemplate(template_path, path)
  return template_path


def _install(tmp: str, out: str) -> None:
  """Puts the finished set in `tmp` at `out`, in place of what --overwrite replaces."""
  umask = os.umask(0)  # mkdtemp's directory is private; the set gets a new directory's mode.
  os.umask(umask)
  os.chmod(tmp, 0o777 & ~umask)
  if not os.path.isdir(out):
    os.rename(tmp, out)
    return
  old = tempfile.mkdtemp(prefix=os.path.basename(out) + '.old-', dir=os.path.dirname(tmp))
  os.rename(out, os.path.join(old, 'set'))
  os.rename(tmp, out)
  shutil.rmtree(old)


def prepare(inputs: list[str], kind: str, path: str, out: str, processes: int = 0,
            record_tokens: int = 4096, records_per_shard: int = 1024,
            piece_bytes: int = 1 << 20, overwrite: bool = False, text_field: str = 'text',
            messages_field: str = '', chat_template: str = '') -> dict:
  """Writes the shard set for `inputs` to `out` (written beside it as OUT.tmp-*, then renamed:
  a failure leaves no set behind); returns its metadata. `text_field`: the field of record
  files' records that holds the text. The inputs are streamed: at most two windows of pieces
  (`_WINDOW_PIECES` per process, each at most `piece_bytes`) are in memory at once.

  `messages_field`: the records hold conversations there, rendered with the chat template
  (`chat_template`, or the one beside the tokenizer file) and marked for a loss on the answers
  (engine/data/chat.py); each is one document, never cut."""
  out = os.path.abspath(out)
  check_arguments(kind, path, out, processes, record_tokens, records_per_shard, overwrite)
  tokenizer = tokenizer_lib.load(kind, path)
  template_path = ''
  if messages_field:
    template_path = _check_chat(kind, path, tokenizer, chat_template)
    work = ((item, False, True) for item in sources.stream_conversations(inputs, messages_field))
  else:  # stream_inputs checks every input before any write.
    work = pieces(sources.stream_inputs(inputs, text_field), piece_bytes)
  processes = processes or os.cpu_count() or 1
  try:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(out) + '.tmp-', dir=os.path.dirname(out))
  except OSError as e:
    raise ConfigError(f'--out={out!r} cannot be created ({e.strerror}); pass a directory path '
                      'you can write.') from e
  start = time.perf_counter()
  try:
    writer = shards.Writer(tmp, tokenizer.vocab_size, record_tokens, records_per_shard,
                           flagged=bool(messages_field))
    num_documents, total_bytes = _tokenize(writer, work, kind, path, processes, template_path)
    recorded = {'kind': kind, 'path': os.path.abspath(path) if kind != 'byte' else '',
                'vocab_size': tokenizer.vocab_size, 'eos_id': tokenizer.eos_id,
                'bos_id': tokenizer.bos_id}
    if kind in shard_meta.FILE_KINDS:
      recorded['sha256'] = shards.sha256(path)
    meta = {'tokenizer': recorded, 'num_documents': num_documents, 'input_bytes': total_bytes,
            'inputs': inputs, 'seconds': time.perf_counter() - start}
    if messages_field:
      meta['chat'] = {'messages_field': messages_field, 'template': os.path.abspath(template_path),
                      'template_sha256': shards.sha256(template_path)}
    meta = writer.close(meta)
    # What only this tokenizer's ids reproduce (shard_meta.check_tokenizer), read back from the
    # written set.
    recorded['decoded_sha256'] = shard_meta.decoded_sha256(
        tokenizer, shards.TokenStream(tmp).record(0))
    shards.write_meta(tmp, meta)
    _install(tmp, out)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  logging.info('Wrote %d tokens in %d shards to %s: %.0f tokens/s with %d processes',
               meta['num_tokens'], len(meta['shards']), out, meta['num_tokens'] / meta['seconds'],
               processes)
  return meta
