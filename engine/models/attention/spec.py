"""One layer's attention as every attention path takes it: an `AttentionSpec`.

The whole-sequence paths (engine/models/attention/causal.py: einsum, dot_product_attention,
splash), ring attention over a sequence split between devices (engine/parallel/context.py) and
attention through generation's cache (engine/parallel/decode.py) each take the queries, keys,
values and one spec. A model builds the spec once from its config (a layer whose options differ,
a local layer's window, replaces that field), so a new option is one field here plus the paths
that compute it; validation refuses it where a path cannot (engine/validation/attention.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ('einsum', 'dot_product_attention', 'splash')
SCALE_ON = ('queries', 'logits')


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """How one layer's causal self-attention computes.

  implementation: the whole-sequence path (IMPLEMENTATIONS); ring attention runs einsum or
    splash blocks; the generation cache computes its own.
  scale: the logits' scale; None: 1 / sqrt(head size).
  scale_on: where the scale goes (SCALE_ON): on the queries before the product (GPT-2, most
    Llama ports) or on the logits after it; the two differ only in rounding (bfloat16 shows it).
  softcap: Gemma 2's soft cap on the scaled logits, c tanh(logits / c), before the mask; None:
    none (the einsum path, ring attention and the cache compute it).
  window: a query sees only the keys fewer than this many positions back (Mistral, Gemma's local
    layers; an int, or traced where the layers differ); None: every key before it (the einsum path
    and the cache compute it).
  """
  implementation: str = 'einsum'
  scale: float | None = None
  scale_on: str = 'queries'
  softcap: float | None = None
  window: int | jax.Array | None = None

  def prescale(self, q_BLHK) -> tuple[jax.Array, float]:
    """(queries, the scale left for the logits): every path scales through here."""
    scale = q_BLHK.shape[-1] ** -0.5 if self.scale is None else self.scale
    if self.scale_on == 'queries':
      return q_BLHK * jnp.asarray(scale, q_BLHK.dtype), 1.0
    return q_BLHK, scale

  def capped(self, logits):
    """The scaled logits as the softmax sees them before the mask (the soft cap)."""
    return soft_cap(logits, self.softcap)

  def visible(self, query_positions, key_positions):
    """Which keys each query sees (broadcast): those at or before it, within the window."""
    seen = key_positions <= query_positions
    if self.window is not None:
      seen = seen & (query_positions - key_positions < self.window)
    return seen


def from_config(model_config) -> AttentionSpec:
  """The spec of the engine-wide `model.attention*` keys (a family adds its own options)."""
  return AttentionSpec(
      implementation=model_config.attention,
      scale=None if model_config.attention_scale == -1 else model_config.attention_scale,
      scale_on=model_config.attention_scale_on)


def soft_cap(logits, cap: float | None):
  """cap tanh(logits / cap) (None: the logits unchanged): Gemma 2's attention and output logits
  kept within (-cap, cap) smoothly."""
  if not cap:
    return logits
  return cap * jnp.tanh(logits / cap)
