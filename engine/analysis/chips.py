"""Published per-chip figures of the accelerators the engine plans and benchmarks for.

Peak dense matmul FLOP/s (no sparsity) per chip, HBM capacity and bandwidth, and interconnect
bandwidth per chip, as the vendors publish them:

  TPU v4, v5e, v5p, v6e: Google Cloud TPU documentation, "System architecture" and each
    version's page (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e).
  A100, H100, H200, L4: NVIDIA's data sheets (SXM parts for A100 / H100 / H200).

On TPUs float32 matmuls run at the bfloat16 rate by default (JAX's DEFAULT precision is one
bfloat16 pass); on NVIDIA GPUs XLA runs them as TF32, whose peak is listed as `float32`.
MFU is always the model's FLOPs over the peak of the compute dtype: an f32 run on an H100 is
measured against TF32, not the 67 TFLOP/s of true FP32.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  device_kinds: tuple[str, ...]  # Words in jax.Device.device_kind that mean this chip.
  peak_tflops: dict[str, float]  # compute dtype -> dense TFLOP/s per chip.
  hbm_gib: float
  hbm_gb_per_s: float  # GB/s.
  interconnect_gb_per_s: float  # GB/s per chip, all ICI / NVLink links together.


CHIPS = (
    Chip('TPU v4', ('TPU v4',), {'bfloat16': 275, 'float32': 275}, 32, 1200, 300),
    Chip('TPU v5e', ('TPU v5 lite', 'TPU v5e'), {'bfloat16': 197, 'float32': 197}, 16, 819,
         200),
    Chip('TPU v5p', ('TPU v5p', 'TPU v5'), {'bfloat16': 459, 'float32': 459}, 95, 2765, 600),
    Chip('TPU v6e', ('TPU v6 lite', 'TPU v6e', 'TPU v6'), {'bfloat16': 918, 'float32': 918}, 32,
         1640, 448),
    Chip('NVIDIA A100', ('A100',), {'bfloat16': 312, 'float32': 156}, 80, 2039, 600),
    Chip('NVIDIA H100', ('H100',), {'bfloat16': 989, 'float32': 495}, 80, 3350, 900),
    Chip('NVIDIA H200', ('H200',), {'bfloat16': 989, 'float32': 495}, 141, 4800, 900),
    Chip('NVIDIA L4', ('L4',), {'bfloat16': 121, 'float32': 60}, 24, 300, 64),
)


def chip_of(device_kind: str) -> Chip | None:
  """The chip a device reports itself as (jax.devices()[0].device_kind), or None (CPUs, and
  chips not in the table)."""
  for chip in CHIPS:  # 'TPU v5 lite' must match v5e before 'TPU v5' matches v5p.
    if any(re.search(rf'\b{re.escape(kind)}\b', device_kind, re.IGNORECASE)
           for kind in chip.device_kinds):
      return chip
  return None


def peak_flops(device_kind: str, dtype: str, override_tflops: float | None = None
               ) -> float | None:
  """Peak FLOP/s of one device for `dtype`: the override where given, else the table's."""
  if override_tflops:
    return override_tflops * 1e12
  chip = chip_of(device_kind)
  return chip.peak_tflops[dtype] * 1e12 if chip and dtype in chip.peak_tflops else None
