"""The Llama family's building blocks beside the projections: RMSNorm and rotary position
embeddings (Hugging Face's `default`, `linear` and `llama3` frequencies), shared by its attention
(engine/models/llama/model.py) and multi-head latent attention
(engine/models/llama/latent_attention.py).

Shape suffixes: B batch, L length, H heads, K head size, D embed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.layers import param


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary frequencies (model.rope_*): Hugging Face's `default`, `linear` and `llama3` types."""
  base: float = 10_000.0
  type: str = 'default'  # llama_config.ROPE_TYPES
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192

  def inverse_frequencies(self, head_dim: int) -> jax.Array:
    """[head_dim / 2] float32: base^(-2i / head_dim), rescaled by the type (as
    transformers' modeling_rope_utils computes them)."""
    half = head_dim // 2
    inverse = self.base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if self.type == 'linear':
      return inverse / self.factor
    if self.type == 'llama3':
      # Wavelengths above original_max_len / low_freq_factor are slowed by `factor`, those below
      # original_max_len / high_freq_factor kept, and the band between interpolated.
      wavelength = 2 * math.pi / inverse
      low = self.original_max_len / self.low_freq_factor
      high = self.original_max_len / self.high_freq_factor
      scaled = jnp.where(wavelength > low, inverse / self.factor, inverse)
      smooth = ((self.original_max_len / wavelength - self.low_freq_factor) /
                (self.high_freq_factor - self.low_freq_factor))
      smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = (wavelength >= high) & (wavelength <= low)
      return jnp.where(medium, smoothed, scaled)
    return inverse


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
    self.scale = param(rngs, (dim,), ('norm',), None)
    self.eps = eps

  def __call__(self, x_BLD):
    x = x_BLD.astype(jnp.float32)  # Statistics in float32 whatever the compute dtype.
    y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x_BLD.dtype)


def rotary(x_BLHK: jax.Array, positions: jax.Array, rope: Rope,
           interleaved: bool = False, inverse_frequency: jax.Array | None = None) -> jax.Array:
  """Rotary position embedding, rotate-half form: dimension i pairs with i + K/2. `positions`
  is [L] (every row alike) or [B, L] (generation: each row at its own position).
  `inverse_frequency` [K / 2]: these frequencies rather than `rope`'s (a layer's own, chosen
  inside the layer stack: Gemma 3's local and global layers).

  `interleaved`: dimension 2i pairs with 2i + 1 instead (DeepSeek's checkpoints, whose
  transformers code reorders each head to [evens, odds] and rotates halves): the same rotation
  of the same pairs, left in place, so dot products of queries and keys are the same."""
  if interleaved:
    *lead, K = x_BLHK.shape
    halves = x_BLHK.reshape(*lead, K // 2, 2).swapaxes(-1, -2).reshape(*lead, K)
    rotated = rotary(halves, positions, rope, inverse_frequency=inverse_frequency)
    return rotated.reshape(*lead, 2, K // 2).swapaxes(-1, -2).reshape(*lead, K)
  half = x_BLHK.shape[-1] // 2
  if inverse_frequency is None:
    inverse_frequency = rope.inverse_frequencies(x_BLHK.shape[-1])
  angles = positions.astype(jnp.float32)[..., None] * inverse_frequency
  angles_K = jnp.concatenate([angles, angles], axis=-1)  # [(B,) L, K]
  x = x_BLHK.astype(jnp.float32)
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  cos, sin = jnp.cos(angles_K)[..., None, :], jnp.sin(angles_K)[..., None, :]
  return (x * cos + rotated * sin).astype(x_BLHK.dtype)
