"""Dense projections in int8 or fp8, forward and backward: Qwix's quantized training.

`model.matmul_precision` picks how every `engine.models.layers.dense` projection (attention's
query / key / value / output, the MLP's, a shared expert's) multiplies, and a capacity
dispatch's experts (`batched_matmul`); the token embedding, the output head, a router and the
dropless dispatch's experts stay in the compute dtype (`model.dtype`: its grouped matmuls'
weight gradients contract over the rows each device routes, which no block size aligns across
layouts):

  default  the compute dtype's matmul.
  int8     both operands of each of the three matmuls (the forward x @ w, and the backward
           pass's dy @ w^T and x^T @ dy) quantized to int8, symmetric, with a scale per channel
           and per block of `model.matmul_block` elements along the contraction, taken from the
           block's absolute maximum (which maps to 127; values round half to even); int8 x int8
           products accumulate in int32 and the scales multiply the per-block sums. MaxText's
           int8 training (Qwix, its recommendation for TPU v5e / v6e, whose int8 peak is twice
           the bfloat16 one) quantizes the same three matmuls.
  fp8      the same with float8_e4m3fn operands forward and float8_e5m2 gradients (their wider
           exponent range) in the backward pass, scaled each step from the blocks' current
           maxima (absmax to the format's largest value, 448 / 57344): "current scaling", no
           history of maxima to carry in the state or to restore.

Why blocks along the contraction rather than one scale per whole channel: a scale over a
whole contraction needs its maximum over every device that holds part of it (a tensor-parallel
row split, the tokens of a data-parallel weight gradient), so per-channel numerics would change
with the mesh. With blocks that divide each device's slice every device computes the scales a
single device would, so both modes on every mesh equal the one-device run (up to the rounding
ties float32 summation order decides)
(engine/validation/precision.py refuses a block that does not divide them). Parameters, gradients
and optimizer state stay in float32: a checkpoint never holds a quantized value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
# Qwix's functional core of quantized training (what its QtProvider calls for each intercepted
# dot_general); the engine calls it directly on its own projections (BUILD.md: why).
from qwix._src.core import dot_general_qt

from engine.models.varying_axes import vary_alike

PRECISIONS = ('default', 'int8', 'fp8')

# Qwix maps an int8 block's absolute maximum to 127.5, a rounding tie that the compiler's choice
# between x / scale and x * (1 / scale) decides either way: the same block would quantize
# differently in two programs (two modes, or a step and its reference). Scaling the maximum by
# 127.5 / 127 maps it to 127, the symmetric int8 range AQT and MaxText use. fp8's maximum maps
# to the format's largest value, which is exact.
_CALIBRATION = {'int8': f'absmax,{127.5 / 127!r}', 'fp8': 'absmax'}

# Forward operands, then gradients, per precision.
_QTYPES = {
    'int8': (jnp.int8, jnp.int8),
    'fp8': (jnp.float8_e4m3fn, jnp.float8_e5m2),
}


@dataclasses.dataclass(frozen=True)
class MatmulPrecision:
  """How a model's dense projections multiply (the module docstring)."""
  name: str = 'default'
  block: int = 128  # Contraction elements per scale.

  @property
  def quantized(self) -> bool:
    return self.name != 'default'


DEFAULT = MatmulPrecision()


def from_config(model_config) -> MatmulPrecision:
  return MatmulPrecision(model_config.matmul_precision, model_config.matmul_block)


def _qt_config(precision: MatmulPrecision):
  operands, gradients = _QTYPES[precision.name]
  block = precision.block
  calibration = {f'{which}_calibration_method': _CALIBRATION[precision.name] for which in (
      'lhs', 'rhs', 'dlhs_grad', 'drhs_grad', 'dlhs_residual', 'drhs_residual')}
  return dot_general_qt.DotGeneralQtConfig(
      lhs_qtype=operands, rhs_qtype=operands, tile_size=block,
      dlhs_grad_qtype=gradients, dlhs_tile_size=block, dlhs_residual_qtype=operands,
      drhs_grad_qtype=gradients, drhs_tile_size=block, drhs_residual_qtype=operands,
      **calibration,
      # The backward pass quantizes x and w again, in blocks along its own contractions (Qwix
      # would reuse the forward pass's quantization where the forward contraction is a single
      # block, and the numerics would then depend on how a mesh splits it). Absmax never clips,
      # so there is no gradient to clip either.
      use_original_residuals=True, disable_gradient_clipping=True)


def matmul(x_NK: jax.Array, w_KF: jax.Array, precision: MatmulPrecision) -> jax.Array:
  """x [N, K] @ w [K, F] in `precision`, in x's dtype."""
  return _dot_general(x_NK, w_KF, (((1,), (0,)), ((), ())), precision)


def batched_matmul(x_ENK: jax.Array, w_EKF: jax.Array, precision: MatmulPrecision) -> jax.Array:
  """x [E, N, K] @ w [E, K, F] for each e (a capacity dispatch's experts), in `precision`."""
  return _dot_general(x_ENK, w_EKF, (((2,), (1,)), ((0,), (0,))), precision)


def _dot_general(x, w, dimension_numbers, precision: MatmulPrecision) -> jax.Array:
  # Typed alike under shard_map, as jnp.dot would cast them: a custom gradient comes back typed
  # like its input.
  x, w = vary_alike(x, w)
  y = dot_general_qt.dot_general_qt(x, w, dimension_numbers, _qt_config(precision))
  return y.astype(x.dtype)

