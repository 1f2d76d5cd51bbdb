"""Causal self-attention over the whole sequence a device holds, by the spec's implementation
(engine/models/attention/spec.py): the einsum path, or `jax.nn.dot_product_attention` (which picks
cuDNN's fused flash attention on GPUs and XLA's implementation elsewhere), or the Pallas TPU
splash-attention kernel (engine/models/attention/splash.py: flash attention that never stores the
[L, L] probabilities). Keys and values keep their own N heads (grouped-query attention: N divides
the H query heads, query head h reads key / value head h // (H / N)); the einsum and
dot_product_attention paths never materialise them per query head. The softmax runs in float32
whatever the compute dtype. With packed documents (engine/models/documents.py) every path also
masks the keys of other documents, given each position's segment id. The spec's soft cap and
sliding window are computed by the einsum path (and by ring attention and the generation cache,
which build on `grouped_logits` / `grouped_values`); validation refuses them on the other two
paths, which have no such step.

Shape suffixes: B batch, L (Q, S) length, H heads, N key / value heads, G = H / N, K head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models.attention import splash
from engine.models.attention.spec import AttentionSpec
from engine.models.documents import same_document


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


def causal_attention(q_BLHK, k_BLNK, v_BLNK, spec: AttentionSpec = AttentionSpec(),
                     segments_BL: jax.Array | None = None):
  """softmax(spec.capped(scale q k^T) + causal mask) v by spec.implementation; keys and values
  of N heads, N dividing the H query heads. `segments_BL`: each position's document (packed
  documents); a query then sees only keys of its own document."""
  q_BLHK, scale = spec.prescale(q_BLHK)
  mask_B1QS = None if segments_BL is None else same_document(segments_BL, segments_BL)
  assert not spec.softcap or spec.implementation == 'einsum', spec  # Validation refuses it.
  if spec.implementation == 'dot_product_attention':  # Grouped-query natively (N < H).
    return jax.nn.dot_product_attention(q_BLHK, k_BLNK, v_BLNK, mask=mask_B1QS, scale=scale,
                                        is_causal=True)
  if spec.implementation == 'splash':
    assert scale == 1.0, spec  # The kernel has no scale: validation keeps it on the queries.
    return splash.causal_attention(q_BLHK, k_BLNK, v_BLNK, segments_BL)
  logits_BHQS = grouped_logits(q_BLHK, k_BLNK)
  if scale != 1.0:
    logits_BHQS = logits_BHQS * scale
  logits_BHQS = spec.capped(logits_BHQS)
  positions_L = jnp.arange(q_BLHK.shape[1])
  visible_BHQS = spec.visible(positions_L[:, None], positions_L)
  if mask_B1QS is not None:
    visible_BHQS = visible_BHQS & mask_B1QS
  logits_BHQS = jnp.where(visible_BHQS, logits_BHQS, jnp.finfo(jnp.float32).min)
  probs_BHQS = jax.nn.softmax(logits_BHQS, axis=-1).astype(v_BLNK.dtype)
  return grouped_values(probs_BHQS, v_BLNK)
