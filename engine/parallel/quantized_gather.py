"""Manual FSDP's weight gathers in int8 or fp8 (parallelism.gather_dtype): half the bytes of
bfloat16 on the wire.

Each weight is quantized per channel: one float32 scale for each position outside its gathered
dimensions, from the channel's absolute maximum over the whole weight (each device's maximum
over its shard, then a pmax over the gathered axes: an all-reduce of the scales alone, 4 bytes
per channel, where gathering per-shard scales would cost 4 bytes per channel and device). Each
device quantizes its shard with those scales, the 1-byte values are all-gathered, and every
device dequantizes the whole weight to the compute dtype. fp8 values travel as their bytes
(uint8), which every compiler gathers as they are. int8 maps a channel's absolute maximum to
127 and rounds half to even; fp8 (float8_e4m3fn) maps it to 448 and rounds to the nearest
representable value.

The forward pass then sees each weight as its quantized image. The backward pass treats the
quantization as the identity (the straight-through estimator, as torchao's float8 all-gather
does): the gradient of the gathered weight is reduce-scattered in parallelism.grad_reduce_dtype,
the transpose of the gather of the unquantized weight. Parameters and optimizer state stay
float32.

What the backward pass re-gathers follows the layer's remat policy: the dequantizing multiply
is an ordinary operation, so model.remat='none' (keep everything) keeps the dequantized weights
too, one gather per step instead of the unquantized gathers' two (which manual mode never keeps,
engine/parallel/manual_ops.py); 'full' and the dots policies gather them again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.parallel import flat_gather

GATHER_DTYPES = ('default', 'int8', 'fp8')

_FORMATS = {'int8': (jnp.int8, 127.0), 'fp8': (jnp.float8_e4m3fn, 448.0)}


def scales(shard: jax.Array, splits: flat_gather.Splits, fmt: str) -> jax.Array:
  """float32 [size 1 along the split dimensions]: each channel's absolute maximum over the whole
  weight (a pmax over the split axes), over the format's largest value."""
  dims = tuple(dim for dim, _ in splits)
  absmax = jnp.max(jnp.abs(shard.astype(jnp.float32)), axis=dims, keepdims=True)
  for _, axes in splits:
    absmax = jax.lax.pmax(absmax, axes)
  return jnp.where(absmax > 0, absmax / _FORMATS[fmt][1], 1.0)


def quantize(shard: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
  dtype, largest = _FORMATS[fmt]
  scaled = shard.astype(jnp.float32) / scale
  if fmt == 'int8':
    scaled = jnp.round(scaled)
  return jnp.clip(scaled, -largest, largest).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather(value: jax.Array, splits: flat_gather.Splits, fmt: str, dtype, reduce_dtype):
  """`value`'s FSDP-split dimensions all-gathered in `fmt` and dequantized to `dtype`; its
  gradient reduce-scattered in `reduce_dtype` as the unquantized gather's would be."""
  scale = scales(value, splits, fmt)
  values = quantize(value, scale, fmt)
  # fp8 travels as its bytes: a compiler without fp8 collectives (XLA:CPU) would otherwise
  # widen the gather to float16, twice the bytes asked for.
  wire = jax.lax.bitcast_convert_type(values, jnp.uint8) if fmt == 'fp8' else values
  gathered = flat_gather.gather(wire, splits)
  if fmt == 'fp8':
    gathered = jax.lax.bitcast_convert_type(gathered, values.dtype)
  return (gathered.astype(jnp.float32) * scale).astype(dtype)


def _gather_forward(value, splits, fmt, dtype, reduce_dtype):
  return gather(value, splits, fmt, dtype, reduce_dtype), jnp.zeros((), value.dtype)


def _gather_backward(splits, fmt, dtype, reduce_dtype, like, grad):
  del fmt, dtype
  return (flat_gather.scatter(grad.astype(reduce_dtype), splits).astype(like.dtype),)


gather.defvjp(_gather_forward, _gather_backward)
