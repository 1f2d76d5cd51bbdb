"""Packed documents (data.document_masking): a training window of L + 1 tokens holds several
documents, each ended by the tokenizer's end-of-text id. Every token gets a segment id (which
document of the window it belongs to; an end-of-text token belongs to the document it ends)
and a position counted from its document's start, so that attention never crosses documents
and positions restart at 0 in each. Derived from the tokens inside the step, before any layout
slices the sequence, so a layout slices them like the tokens.

A shard set of conversations (engine/data/chat.py) carries its loss mask in the token ids
themselves, so that it travels with the tokens through every layout: CONTEXT_FLAG marks a token
no prediction of which is trained (a prompt's, the separator after a conversation), and
INSIDE_FLAG an end-of-text id within a conversation (a chat template's end of turn), which does
not end the document. `token_ids` strips both.

Shape suffixes: B batch, L1 window length (L + 1), Q queries, S keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


CONTEXT_FLAG = 1 << 30
INSIDE_FLAG = 1 << 29
ID_BITS = INSIDE_FLAG - 1


def token_ids(tokens):
  """The ids of flagged tokens (jax or NumPy arrays of int32 or wider)."""
  return tokens & ID_BITS


def document_ends(tokens, eos_id: int):
  """Whether each token ends its document: an end-of-text id not flagged as inside one."""
  return (token_ids(tokens) == eos_id) & ((tokens & INSIDE_FLAG) == 0)


def trained_targets(tokens):
  """Whether a prediction of each token is trained: it is not flagged as context."""
  return (tokens & CONTEXT_FLAG) == 0


def segments_and_positions(tokens_BL1: jax.Array, eos_id: int) -> tuple[jax.Array, jax.Array]:
  """(segment ids, positions within the document), both int32 [B, L1]."""
  ends_BL1 = document_ends(tokens_BL1, eos_id).astype(jnp.int32)
  # A document starts after each end-of-text: the count of those before a token is its segment.
  segments_BL1 = jnp.cumsum(ends_BL1, axis=1) - ends_BL1
  index_BL1 = jnp.broadcast_to(jnp.arange(tokens_BL1.shape[1], dtype=jnp.int32),
                               tokens_BL1.shape)
  # Each token's document start: the latest index that follows an end-of-text (or 0).
  starts_BL1 = jnp.pad(jnp.where(ends_BL1[:, :-1] == 1, index_BL1[:, 1:], 0), ((0, 0), (1, 0)))
  starts_BL1 = jax.lax.cummax(starts_BL1, axis=1)
  return segments_BL1, index_BL1 - starts_BL1


def same_document(segments_q_BQ: jax.Array, segments_k_BS: jax.Array) -> jax.Array:
  """[B, 1, Q, S] bool: query and key in the same document (broadcasts over heads)."""
  return segments_q_BQ[:, None, :, None] == segments_k_BS[:, None, None, :]
