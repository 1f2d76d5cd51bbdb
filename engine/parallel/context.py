"""Context (sequence) parallelism in manual mode: the load-balanced split of every sequence over
the `context` axis, and ring attention over it.

Load balance. Under a causal mask, late positions attend to more keys than early ones, so a
contiguous split would give the last device most of the work. Instead every sequence is cut into
2C chunks (C = the context axis size) and device c holds chunks c and 2C-1-c: one early, one
late ("zigzag"), so every device does the same work.

Ring attention. Each device keeps its queries and passes its keys and values around the ring
with `ppermute`, C-1 times (their own N key / value heads, grouped-query attention's fewer than
the H query heads: each block is matched to its query heads where it is used); the softmax is
accumulated online (running maximum, normaliser and weighted sum, in float32), so no device ever
holds the whole sequence's keys. With the zigzag layout, of the four (query chunk, key chunk)
blocks a visiting device brings, one is always fully visible (late queries, early keys), one
fully masked (early queries, late keys) and skipped, and exactly one of the two others is fully
visible: every device computes two unmasked blocks per ring step. Packed documents
(engine/models/documents.py): the keys' segment ids travel with them and every block also masks
other documents' keys; the causal skipping is unchanged (a row of a block may then be fully
masked: the merge gives it weight exp(min - max) = 0, and every query sees itself in its own
chunk). The backward pass is JAX's transpose: each permute becomes one in the other direction.

With model.attention='splash' each block runs the Pallas splash kernel
(engine/models/attention/splash.py, block_attention: causal mask on the diagonal blocks, full mask
on the visible ones), which returns the block's normalised output (in the compute dtype: bfloat16
blocks are rounded before the float32 merge) and its log-sum-exp; blocks merge with log-sum-exp
weights. Its gradient is exact: each block's custom_vjp runs the kernel's own backward passes, its
log-sum-exp's cotangent included, and autodiff carries the merges and the ring. Packed
documents: each block's kernel takes the queries' and the travelling keys' segment ids
(SegmentIds, forward and backward); a row of a block that sees no key gets a finite log-sum-exp
near the kernel's mask value and weight 0 in the merge (_splash_block).

Shape suffixes as in the models: B batch, L length (Q queries, S keys), H heads, N key / value
heads, K head_dim; C the context axis size, T = L / (2C) the chunk length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models.attention import splash
from engine.models.attention.causal import grouped_logits, grouped_values
from engine.models.attention.spec import AttentionSpec
from engine.models.documents import same_document

_MASKED = jnp.finfo(jnp.float32).min


def chunk_starts(axis: str, size: int, chunk: int) -> tuple[jax.Array, jax.Array]:
  """Where this device's two chunks start in the whole sequence (traced: depends on the device)."""
  index = jax.lax.axis_index(axis)
  return index * chunk, (2 * size - 1 - index) * chunk


def local_sequence(tokens_BL1: jax.Array, axis: str, size: int):
  """This device's inputs and targets [B, 2T] from the whole sequences [B, L + 1]."""
  length = tokens_BL1.shape[1] - 1
  chunk = length // (2 * size)
  first, second = chunk_starts(axis, size, chunk)
  take = lambda start, offset: jax.lax.dynamic_slice_in_dim(tokens_BL1, start + offset, chunk, 1)
  inputs = jnp.concatenate([take(first, 0), take(second, 0)], axis=1)
  targets = jnp.concatenate([take(first, 1), take(second, 1)], axis=1)
  return inputs, targets


def local_positions(local_length: int, axis: str, size: int) -> jax.Array:
  """The whole-sequence position of each of this device's `local_length` = 2T tokens."""
  chunk = local_length // 2
  first, second = chunk_starts(axis, size, chunk)
  offsets = jnp.arange(chunk)
  return jnp.concatenate([first + offsets, second + offsets])


def _block(q_BQHK, k_BSNK, v_BSNK, scale: float, causal: bool, segments, spec: AttentionSpec):
  """Softmax statistics of one (query chunk, key chunk) block: running max m [B, H, Q],
  normaliser l [B, H, Q] and unnormalised output o [B, Q, H, K], all float32. The visiting keys
  and values keep their N heads; each query head reads its own (grouped einsums). `segments`:
  (the queries' [B, Q], the keys' [B, S]) segment ids, or None (one document). `spec`
  caps the logits as the whole sequence's are."""
  logits_BHQS = grouped_logits(q_BQHK, k_BSNK)
  if scale != 1.0:
    logits_BHQS = logits_BHQS * scale
  logits_BHQS = spec.capped(logits_BHQS)
  if segments is not None:
    logits_BHQS = jnp.where(same_document(*segments), logits_BHQS, _MASKED)
  if causal:  # Same chunk: position q sees keys up to itself.
    length = q_BQHK.shape[1]
    logits_BHQS = jnp.where(jnp.tril(jnp.ones((length, length), bool)), logits_BHQS, _MASKED)
  m_BHQ = logits_BHQS.max(-1)
  p_BHQS = jnp.exp(logits_BHQS - m_BHQ[..., None])
  o_BQHK = grouped_values(p_BHQS.astype(v_BSNK.dtype), v_BSNK, jnp.float32)
  return m_BHQ, p_BHQS.sum(-1), o_BQHK


def _merge(a, b):
  """Two blocks' statistics for the same queries, as if computed over both key sets."""
  (m1, l1, o1), (m2, l2, o2) = a, b
  m = jnp.maximum(m1, m2)
  c1, c2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
  per_query = lambda c: c.transpose(0, 2, 1)[..., None]  # [B, H, Q] -> [B, Q, H, 1]
  return m, l1 * c1 + l2 * c2, o1 * per_query(c1) + o2 * per_query(c2)


def _finish(stats):
  """The attention output [B, Q, H, K] float32 of merged (m, l, o) statistics."""
  return stats[2] / stats[1].transpose(0, 2, 1)[..., None]


def _splash_block(q_BQHK, k_BSNK, v_BSNK, causal: bool, segments=None):
  """One block through the kernel: its log-sum-exp [B, H, Q] and output [B, Q, H, K], float32.
  `segments`: (queries', keys') segment ids, or None. A query that sees no key of the block
  (another document's) gets a log-sum-exp near the kernel's mask value, -0.7 * float32 max:
  finite, so the merge gives it weight exp(lse_row - lse) = 0 exactly, and gradient 0, with no
  inf - inf (every query sees itself in its diagonal block, so the merged lse is a real one)."""
  o_BQHK, lse_BHQ = splash.block_attention(q_BQHK, k_BSNK, v_BSNK, causal, segments)
  return lse_BHQ, o_BQHK.astype(jnp.float32)


def _merge_splash(a, b):
  """Two normalised blocks for the same queries, weighted by their share of the softmax mass."""
  (lse1, o1), (lse2, o2) = a, b
  lse = jnp.logaddexp(lse1, lse2)
  weight = lambda part: jnp.exp(part - lse).transpose(0, 2, 1)[..., None]  # [B, Q, H, 1]
  return lse, o1 * weight(lse1) + o2 * weight(lse2)


def _block_ops(spec: AttentionSpec, scale: float):
  """(block(q, k, v, causal, segments), merge, finish) of the spec's implementation's
  statistics, `scale` the scale left for the logits."""
  if spec.implementation == 'splash':  # Validation keeps the scale on the queries: none is left.
    assert scale == 1.0, scale
    return _splash_block, _merge_splash, lambda stats: stats[1]
  block = lambda q, k, v, causal, segments: _block(q, k, v, scale, causal, segments, spec)
  return block, _merge, _finish


def _select(pick_first, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pick_first, x, y), a, b)


def ring_attention(q_BLHK, k_BLNK, v_BLNK, spec: AttentionSpec, axis: str,
                   segments_BL: jax.Array | None = None) -> jax.Array:
  """Causal attention of this device's queries (its two chunks) over the whole sequence, whose
  keys and values travel around the `axis` ring with their own N heads (grouped-query attention:
  N < H moves H / N times fewer bytes than the query heads would). Equal to
  engine.models.attention.causal's causal_attention on the whole sequence, up to float32 rounding.
  spec.implementation: 'einsum' or 'splash' (the kernel per block); its soft cap is computed, a
  window shorter than the sequence is refused by validation. `segments_BL`: this device's
  positions' segment ids (packed documents), or None."""
  size = jax.lax.axis_size(axis)
  q_BLHK, scale = spec.prescale(q_BLHK)
  block_of, merge, finish = _block_ops(spec, scale)
  chunk = q_BLHK.shape[1] // 2
  halves = lambda x: (x[:, :chunk], x[:, chunk:])
  q_early, q_late = halves(q_BLHK)
  me = jax.lax.axis_index(axis)
  # The queries' segment ids by chunk; (queries', keys') pairs for _block (None: no documents).
  sq_early, sq_late = halves(segments_BL) if segments_BL is not None else (None, None)
  pair = lambda sq, sk: None if segments_BL is None else (sq, sk)

  # Own keys: early queries see early keys causally; late queries see all early keys and late
  # keys causally.
  (k_early, k_late), (v_early, v_late) = halves(k_BLNK), halves(v_BLNK)
  early = block_of(q_early, k_early, v_early, True, pair(sq_early, sq_early))
  late = merge(block_of(q_late, k_early, v_early, False, pair(sq_late, sq_early)),
               block_of(q_late, k_late, v_late, True, pair(sq_late, sq_late)))

  to_next = [(i, (i + 1) % size) for i in range(size)]
  kv = (k_BLNK, v_BLNK) if segments_BL is None else (k_BLNK, v_BLNK, segments_BL)
  for step in range(1, size):
    kv = jax.lax.ppermute(kv, axis, to_next)
    source = (me - step) % size  # Whose keys these are: its chunks are `source`, 2C-1-source.
    (k_early, k_late), (v_early, v_late) = halves(kv[0]), halves(kv[1])
    sk_early, sk_late = halves(kv[2]) if segments_BL is not None else (None, None)
    # Late queries see every early chunk of another device.
    late = merge(late, block_of(q_late, k_early, v_early, False, pair(sq_late, sk_early)))
    # Early queries see an early chunk before theirs; late queries a late chunk before theirs.
    # Exactly one holds; compute that block only.
    earlier = source < me
    pick = lambda a, b: None if a is None else jnp.where(earlier, a, b)
    block = block_of(pick(q_early, q_late), pick(k_early, k_late), pick(v_early, v_late),
                     False, pair(pick(sq_early, sq_late), pick(sk_early, sk_late)))
    early = _select(earlier, merge(early, block), early)
    late = _select(earlier, late, merge(late, block))

  return jnp.concatenate([finish(early), finish(late)], axis=1).astype(v_BLNK.dtype)
