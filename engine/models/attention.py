"""Causal self-attention on heads that are already laid out: the einsum path, or
`jax.nn.dot_product_attention` (which picks cuDNN's fused flash attention on GPUs and XLA's
implementation elsewhere). Both take queries, keys and values of the same heads; the softmax runs
in float32 whatever the compute dtype.

Shape suffixes: B batch, L (Q, S) length, H heads, K head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ('einsum', 'dot_product_attention')
SCALE_ON = ('queries', 'logits')


def causal_attention(q_BLHK, k_BLHK, v_BLHK, scale_on: str = 'queries',
                     implementation: str = 'einsum'):
  """softmax(q k^T / sqrt(K) + causal mask) v. `scale_on` says where 1/sqrt(K) is applied:
  to the queries before the product (GPT-2, most Llama ports) or to the logits after it; the two
  differ only in rounding, which shows in bfloat16."""
  scale = q_BLHK.shape[-1] ** -0.5
  if scale_on == 'queries':
    q_BLHK, scale = q_BLHK * jnp.asarray(scale, q_BLHK.dtype), 1.0
  if implementation == 'dot_product_attention':
    return jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, scale=scale, is_causal=True)
  logits_BHQS = jnp.einsum('BQHK,BSHK->BHQS', q_BLHK, k_BLHK,
                           preferred_element_type=jnp.float32)
  if scale != 1.0:
    logits_BHQS = logits_BHQS * scale
  length = q_BLHK.shape[1]
  causal_QS = jnp.tril(jnp.ones((length, length), bool))
  logits_BHQS = jnp.where(causal_QS, logits_BHQS, jnp.finfo(jnp.float32).min)
  probs_BHQS = jax.nn.softmax(logits_BHQS, axis=-1).astype(v_BLHK.dtype)
  return jnp.einsum('BHQS,BSHK->BQHK', probs_BHQS, v_BLHK)
