"""Causal self-attention on heads that are already laid out: the einsum path, or
`jax.nn.dot_product_attention` (which picks cuDNN's fused flash attention on GPUs and XLA's
implementation elsewhere), or the Pallas TPU splash-attention kernel
(engine/models/attention/splash.py: flash attention that never stores the [L, L] probabilities).
Keys and values keep their own N heads (grouped-query attention: N divides the H query heads, query
head h reads key / value head h // (H / N)); the einsum and dot_product_attention paths never
materialise them per query head. The softmax runs in float32 whatever the compute dtype. With packed
documents (engine/models/documents.py) every path also masks the keys of other documents, given each
position's segment id. Gemma 2 caps the scaled logits softly, c tanh(logits / c), before the
mask (`softcap`; the einsum path, ring attention and the generation cache compute it, and
validation refuses it with the other two paths, which have no such step). A sliding window
(`window`: a query sees the keys fewer than that many positions back, itself included; Mistral,
Gemma's local layers) is computed by the einsum path and the generation cache; validation
refuses a window shorter than the sequence on the other paths, which ignore it.

Shape suffixes: B batch, L (Q, S) length, H heads, N key / value heads, G = H / N, K head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models.attention import splash
from engine.models.documents import same_document

IMPLEMENTATIONS = ('einsum', 'dot_product_attention', 'splash')
SCALE_ON = ('queries', 'logits')


def prescale(q_BLHK, scale: float | None, scale_on: str):
  """(queries, the scale left for the logits): the logit scale (None: 1/sqrt(K), K the head
  size) goes on the queries before the product (GPT-2, most Llama ports) or on the logits
  after it; the two differ only in rounding, which shows in bfloat16. Every attention path
  (this module, ring attention, the generation cache) scales through here."""
  scale = q_BLHK.shape[-1] ** -0.5 if scale is None else scale
  if scale_on == 'queries':
    return q_BLHK * jnp.asarray(scale, q_BLHK.dtype), 1.0
  return q_BLHK, scale


def soft_cap(logits, cap: float | None):
  """cap tanh(logits / cap) (None: the logits unchanged): Gemma 2's attention and output logits
  kept within (-cap, cap) smoothly."""
  if not cap:
    return logits
  return cap * jnp.tanh(logits / cap)


def grouped_logits(q_BQHK, k_BSNK):
  """q k^T [B, H, Q, S] in float32, each query head against its key head: a grouped einsum over
  [B, Q, N, G, K] queries, so the keys are never repeated G times."""
  B, Q, H, K = q_BQHK.shape
  N = k_BSNK.shape[2]
  logits_BNGQS = jnp.einsum('BQNGK,BSNK->BNGQS', q_BQHK.reshape(B, Q, N, H // N, K), k_BSNK,
                            preferred_element_type=jnp.float32)
  return logits_BNGQS.reshape(B, H, Q, -1)


def grouped_values(p_BHQS, v_BSNK, preferred_element_type=None):
  """p v [B, Q, H, K]: each query head's weights over its value head (grouped_logits' layout)."""
  B, H, Q, S = p_BHQS.shape
  N = v_BSNK.shape[2]
  o_BQNGK = jnp.einsum('BNGQS,BSNK->BQNGK', p_BHQS.reshape(B, N, H // N, Q, S), v_BSNK,
                       preferred_element_type=preferred_element_type)
  return o_BQNGK.reshape(B, Q, H, -1)


def causal_attention(q_BLHK, k_BLNK, v_BLNK, scale_on: str = 'queries',
                     implementation: str = 'einsum', scale: float | None = None,
                     segments_BL: jax.Array | None = None, softcap: float | None = None,
                     window=None):
  """softmax(soft_cap(scale q k^T) + causal mask) v, scale 1/sqrt(K) unless given (prescale);
  keys and values of N heads, N dividing the H query heads. `segments_BL`: each position's
  document (packed documents); a query then sees only keys of its own document. `window` (an
  int, or traced: a layer's own): each query sees only the keys fewer than `window` positions
  back (the einsum path; None: all before it)."""
  q_BLHK, scale = prescale(q_BLHK, scale, scale_on)
  mask_B1QS = None if segments_BL is None else same_document(segments_BL, segments_BL)
  assert not softcap or implementation == 'einsum', implementation  # Validation refuses it.
  if implementation == 'dot_product_attention':  # Grouped-query natively (N < H).
    return jax.nn.dot_product_attention(q_BLHK, k_BLNK, v_BLNK, mask=mask_B1QS, scale=scale,
                                        is_causal=True)
  if implementation == 'splash':  # The kernel has no scale: validation keeps it on the queries.
    assert scale == 1.0, scale_on
    return splash.causal_attention(q_BLHK, k_BLNK, v_BLNK, segments_BL)
  logits_BHQS = grouped_logits(q_BLHK, k_BLNK)
  if scale != 1.0:
    logits_BHQS = logits_BHQS * scale
  logits_BHQS = soft_cap(logits_BHQS, softcap)
  length = q_BLHK.shape[1]
  visible_BHQS = jnp.tril(jnp.ones((length, length), bool))
  if window is not None:
    visible_BHQS = visible_BHQS & (jnp.arange(length)[:, None] - jnp.arange(length) < window)
  if mask_B1QS is not None:
    visible_BHQS = visible_BHQS & mask_B1QS
  logits_BHQS = jnp.where(visible_BHQS, logits_BHQS, jnp.finfo(jnp.float32).min)
  probs_BHQS = jax.nn.softmax(logits_BHQS, axis=-1).astype(v_BLNK.dtype)
  return grouped_values(probs_BHQS, v_BLNK)
