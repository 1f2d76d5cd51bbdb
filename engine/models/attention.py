"""Causal self-attention on heads that are already laid out: the einsum path, or
`jax.nn.dot_product_attention` (which picks cuDNN's fused flash attention on GPUs and XLA's
implementation elsewhere), or the Pallas TPU splash-attention kernel (engine/models/splash.py:
flash attention that never stores the [L, L] probabilities). All take queries, keys and values
of the same heads; the softmax runs in float32 whatever the compute dtype.

Shape suffixes: B batch, L (Q, S) length, H heads, K head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models import splash

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


def causal_attention(q_BLHK, k_BLHK, v_BLHK, scale_on: str = 'queries',
                     implementation: str = 'einsum', scale: float | None = None):
  """softmax(scale q k^T + causal mask) v, scale 1/sqrt(K) unless given (prescale)."""
  q_BLHK, scale = prescale(q_BLHK, scale, scale_on)
  if implementation == 'dot_product_attention':
    return jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, scale=scale, is_causal=True)
  if implementation == 'splash':  # The kernel has no scale: validation keeps it on the queries.
    assert scale == 1.0, scale_on
    return splash.causal_attention(q_BLHK, k_BLHK, v_BLHK)
  logits_BHQS = jnp.einsum('BQHK,BSHK->BHQS', q_BLHK, k_BLHK,
                           preferred_element_type=jnp.float32)
  if scale != 1.0:
    logits_BHQS = logits_BHQS * scale
  length = q_BLHK.shape[1]
  causal_QS = jnp.tril(jnp.ones((length, length), bool))
  logits_BHQS = jnp.where(causal_QS, logits_BHQS, jnp.finfo(jnp.float32).min)
  probs_BHQS = jax.nn.softmax(logits_BHQS, axis=-1).astype(v_BLHK.dtype)
  return jnp.einsum('BHQS,BSHK->BQHK', probs_BHQS, v_BLHK)
