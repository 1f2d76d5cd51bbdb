"""Manual FSDP's weight gathers in int8 or fp8 (parallelism.gather_dtype): half the bytes of
bfloat16 on the wire.

Each device quantizes its own shard before the all-gather, with one float32 scale per position
outside the gathered dimensions (absmax over the shard's extent along them: the shard is the
block), gathers the 1-byte values and the scales, and dequantizes after the gather to the
compute dtype. The scales travel as a second, small all-gather (1 / shard extent of the
values' count, in float32); fp8 values travel as their bytes (uint8), which every compiler
gathers as they are. int8 maps a block's absolute maximum to 127 and rounds half to even;
fp8 (float8_e4m3fn) maps it to 448 and rounds to the nearest representable value.

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


def quantize(shard: jax.Array, dims: tuple[int, ...], fmt: str):
  """(values in the 1-byte format, float32 scales with size 1 along `dims`)."""
  dtype, largest = _FORMATS[fmt]
  shard = shard.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(shard), axis=dims, keepdims=True)
  scale = jnp.where(absmax > 0, absmax / largest, 1.0)
  scaled = shard / scale
  if fmt == 'int8':
    scaled = jnp.round(scaled)
  return jnp.clip(scaled, -largest, largest).astype(dtype), scale


def dequantize(values: jax.Array, scales: jax.Array, dims: tuple[int, ...], dtype) -> jax.Array:
  """Each block of `values` (as many along each of `dims` as `scales` has entries there) times
  its scale."""
  for dim in dims:
    scales = jnp.repeat(scales, values.shape[dim] // scales.shape[dim], axis=dim)
  return (values.astype(jnp.float32) * scales).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather(value: jax.Array, splits: flat_gather.Splits, fmt: str, dtype, reduce_dtype):
  """`value`'s FSDP-split dimensions all-gathered in `fmt` and dequantized to `dtype`; its
  gradient reduce-scattered in `reduce_dtype` as the unquantized gather's would be."""
  dims = tuple(dim for dim, _ in splits)
  values, scales = quantize(value, dims, fmt)
  # fp8 travels as its bytes: a compiler without fp8 collectives (XLA:CPU) would otherwise
  # widen the gather to float16, twice the bytes asked for.
  wire = jax.lax.bitcast_convert_type(values, jnp.uint8) if fmt == 'fp8' else values
  gathered = flat_gather.gather(wire, splits)
  if fmt == 'fp8':
    gathered = jax.lax.bitcast_convert_type(gathered, values.dtype)
  return dequantize(gathered, flat_gather.gather(scales, splits), dims, dtype)


def _gather_forward(value, splits, fmt, dtype, reduce_dtype):
  return gather(value, splits, fmt, dtype, reduce_dtype), jnp.zeros((), value.dtype)


def _gather_backward(splits, fmt, dtype, reduce_dtype, like, grad):
  del fmt, dtype
  return (flat_gather.scatter(grad.astype(reduce_dtype), splits).astype(like.dtype),)


gather.defvjp(_gather_forward, _gather_backward)
