"""Tokenizers: bytes, characters, and subword tokenizers through their maintained libraries.

  byte           the UTF-8 bytes (256 ids); no special tokens.
  char           the sorted characters of the corpus; no special tokens.
  hf             a Hugging Face `tokenizer.json` (the `tokenizers` library): BPE, WordPiece,
                 Unigram, whatever the file describes; `python -m engine.data.train_tokenizer`
                 trains a byte-level BPE one on any text, the embedded corpus included.
  sentencepiece  a SentencePiece `.model` file.

Every tokenizer encodes text to int32 ids and decodes them back; a subword one also names its
end-of-text id (and beginning-of-text id, where it has one), which bracket each document in a
token stream (engine.data.prepare). `byte_lengths(ids)` counts the UTF-8 bytes each id stands
for (special tokens: none), for bits per byte (engine.evaluate): exact for byte, char,
SentencePiece and byte-level BPE tokenizers (train_tokenizer's, GPT-2's, Llama 3's, Qwen's),
whose tokens may each hold part of a character; another hf tokenizer's tokens are each decoded
alone.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from engine.config import TOKENIZERS as KINDS  # noqa: F401 (the choices, kept with the schema)
from engine.errors import ConfigError
# Names tried, in order, for a tokenizer.json's end-of-text and beginning-of-text tokens.
END_OF_TEXT = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>', '[SEP]')
BEGIN_OF_TEXT = ('<|begin_of_text|>', '<s>', '<bos>', '[CLS]')


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  kind = 'byte'
  vocab_size = 256
  eos_id = bos_id = None

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids).decode('utf-8', errors='replace')

  def byte_lengths(self, ids) -> np.ndarray:
    return np.ones(np.shape(ids), np.int64)


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  chars: str  # The vocabulary: the corpus's distinct characters, sorted.
  kind = 'char'
  eos_id = bos_id = None

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(self.chars)}
    return np.fromiter((index[c] for c in text), np.int32, len(text))

  def decode(self, ids) -> str:
    return ''.join(self.chars[int(i)] for i in ids)

  def byte_lengths(self, ids) -> np.ndarray:
    return _per_id(ids, lambda i: len(self.chars[i].encode('utf-8')))


class HFTokenizer:
  """A Hugging Face `tokenizer.json`."""
  kind = 'hf'

  def __init__(self, path: str):
    import tokenizers  # pylint: disable=g-import-not-at-top
    self.path = path
    self._tokenizer = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tokenizer.get_vocab_size()
    first = lambda names: next((i for i in map(self._tokenizer.token_to_id, names)
                                if i is not None), None)
    self.eos_id, self.bos_id = first(END_OF_TEXT), first(BEGIN_OF_TEXT)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def byte_lengths(self, ids) -> np.ndarray:
    import tokenizers  # pylint: disable=g-import-not-at-top
    special = set(self._tokenizer.get_added_tokens_decoder())
    # Byte-level: each character of a token's string stands for one byte.
    alphabet = (set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
                if isinstance(self._tokenizer.decoder, tokenizers.decoders.ByteLevel) else set())

    def length(i: int) -> int:
      token = self._tokenizer.id_to_token(i)
      if i in special or token is None:
        return 0
      if alphabet and set(token) <= alphabet:
        return len(token)
      if re.fullmatch(r'<0x[0-9A-Fa-f]{2}>', token):  # A byte-fallback piece.
        return 1
      return len(self._tokenizer.decode([i], skip_special_tokens=False).encode('utf-8'))

    return _per_id(ids, length)


class SentencePieceTokenizer:
  """A SentencePiece `.model` file."""
  kind = 'sentencepiece'

  def __init__(self, path: str):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self.path = path
    self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self._processor.get_piece_size()
    self.eos_id = self._processor.eos_id() if self._processor.eos_id() >= 0 else None
    self.bos_id = self._processor.bos_id() if self._processor.bos_id() >= 0 else None

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._processor.encode(text), np.int32)

  def decode(self, ids) -> str:
    return self._processor.decode([int(i) for i in ids])

  def byte_lengths(self, ids) -> np.ndarray:
    sp = self._processor

    def length(i: int) -> int:
      if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
        return 0
      # A byte piece is one byte; '▁' marks a space (the dummy prefix's counts too).
      return 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace('▁', ' ').encode('utf-8'))

    return _per_id(ids, length)


def _per_id(ids, length_of) -> np.ndarray:
  """length_of(id) for every entry of `ids`, each distinct id computed once."""
  unique, inverse = np.unique(np.asarray(ids), return_inverse=True)
  lengths = np.array([length_of(int(i)) for i in unique], np.int64)
  return lengths[inverse.reshape(-1)].reshape(np.shape(ids))


def load(kind: str, path: str = '', text: str = ''):
  """The tokenizer `kind` (a file for hf and sentencepiece; the corpus `text` for char)."""
  if kind == 'byte':
    return ByteTokenizer()
  if kind == 'char':
    return CharTokenizer(''.join(sorted(set(text))))
  if kind not in KINDS:
    raise ConfigError(f'data.tokenizer={kind!r} is unknown; choose one of {KINDS}.')
  if not path or not os.path.isfile(path):
    raise ConfigError(
        f'data.tokenizer={kind!r} reads data.tokenizer_path, but {path!r} is not a file; pass '
        f'--config.data.tokenizer_path=PATH ({"tokenizer.json" if kind == "hf" else ".model"}; '
        'python -m engine.data.train_tokenizer makes a tokenizer.json from any text).')
  try:
    return HFTokenizer(path) if kind == 'hf' else SentencePieceTokenizer(path)
  except Exception as e:  # The libraries raise their own types for unreadable files.
    raise ConfigError(f'data.tokenizer_path={path!r} is not a {kind} tokenizer file ('
                      f'{str(e).splitlines()[0] if str(e) else type(e).__name__}).') from e
