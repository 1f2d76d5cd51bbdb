"""A prompt's ids: the tokenizer's beginning-of-text id first (as every training document starts
with it: engine.data.prepare), then the text's, with a clear error for characters a character
vocabulary lacks. Generation, evaluation and the training loop's samples encode text this way.
"""

from __future__ import annotations

import numpy as np

from engine.data.tokenizers import CharTokenizer
from engine.errors import ConfigError


def encode_prompt(tokenizer, text: str, what: str = '--prompt') -> np.ndarray:
  """The text's ids; a clear error for characters outside a character vocabulary."""
  if isinstance(tokenizer, CharTokenizer):
    unknown = sorted(set(text) - set(tokenizer.chars))
    if unknown:
      raise ConfigError(
          f'{what} has characters the run\'s character vocabulary lacks: {unknown[:20]}; use '
          f'only these {len(tokenizer.chars)}: {tokenizer.chars!r}.')
  return tokenizer.encode(text)


def bos_ids(tokenizer, add_bos: bool = True) -> list[int]:
  """[the tokenizer's beginning-of-text id] with add_bos if it has one (each document of the
  training stream starts with it: engine.data.prepare), else []."""
  return [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []


def encode_prompts(tokenizer, texts: list[str], add_bos: bool = True,
                   what: str = '--prompt') -> list[np.ndarray]:
  """Each text's ids (encode_prompt), after the beginning-of-text id (bos_ids)."""
  first = np.asarray(bos_ids(tokenizer, add_bos), np.int32)
  return [np.concatenate([first, encode_prompt(tokenizer, text, what)]) for text in texts]
