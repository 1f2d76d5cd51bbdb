"""NumPy's account of a quantized projection (engine/models/quantized_matmul.py), forward and
backward, written from the recipe rather than from the library that implements it: each operand
quantized in blocks of `block` elements along the matmul's contraction, one scale per channel and
block (the block's absolute maximum maps to 127, or to the fp8 format's largest value; values
are multiplied by the scale's float32 reciprocal, as the library does), the products summed per
block and scaled."""

from __future__ import annotations

import ml_dtypes
import numpy as np

_FORMATS = {  # precision: (forward operands, gradients)
    'int8': ('int8', 'int8'),
    'fp8': ('float8_e4m3fn', 'float8_e5m2'),
}


def _scale(absmax: np.ndarray, fmt: str) -> np.ndarray:
  """absmax / 127 for int8 and absmax / the largest value for fp8, in the library's float32
  steps (for int8: absmax x (127.5 / 127) x (1 / 127.5))."""
  if fmt == 'int8':
    return absmax * np.float32(127.5 / 127) * np.float32(1 / 127.5)
  return absmax * np.float32(1 / float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max))


def _quantize_blocks(a_CK: np.ndarray, fmt: str, block: int):
  """[C, K] quantized along K in blocks: (values [C, K / block, block], scales [C, K / block, 1])."""
  a = a_CK.astype(np.float32).reshape(a_CK.shape[0], -1, block)
  scale = _scale(np.abs(a).max(axis=2, keepdims=True), fmt)
  scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale)
  scaled = a * (np.float32(1) / scale)
  if fmt == 'int8':
    values = np.clip(np.round(scaled), -128, 127)
  else:
    limit = ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max
    values = np.clip(scaled, -limit, limit).astype(getattr(ml_dtypes, fmt)).astype(np.float32)
  return values.astype(np.float64), scale.astype(np.float64)


def blocked_matmul(a_MK: np.ndarray, b_KN: np.ndarray, formats: tuple[str, str], block: int):
  """a @ b with a quantized per row and b per column, both in blocks along K."""
  qa, sa = _quantize_blocks(a_MK, formats[0], block)  # [M, T, b], [M, T, 1]
  qb, sb = _quantize_blocks(b_KN.T, formats[1], block)  # [N, T, b], [N, T, 1]
  partial = np.einsum('mtb,ntb->mnt', qa, qb)
  return (partial * sa[:, None, :, 0] * sb[None, :, :, 0]).sum(axis=2)


def quantized_dense(x_NK, w_KF, dy_NF, precision: str, block: int):
  """(y, dx, dw) of y = x @ w in `precision`, with the output's cotangent dy."""
  operands, gradients = _FORMATS[precision]
  y = blocked_matmul(x_NK, w_KF, (operands, operands), block)
  dx = blocked_matmul(dy_NF, w_KF.T, (gradients, operands), block)
  dw = blocked_matmul(x_NK.T, dy_NF, (operands, gradients), block)
  return y, dx, dw
