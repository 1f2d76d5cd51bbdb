"""Published per-chip figures of the accelerators the engine plans and benchmarks for.

Peak dense matmul FLOP/s (no sparsity) per chip, HBM capacity and bandwidth, and interconnect
bandwidth per chip, as the vendors publish them:

  TPU v4, v5e, v5p, v6e: Google Cloud TPU documentation, "System architecture" and each
    version's page (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e).
  A100, H100, H200, L4: NVIDIA's data sheets (SXM parts for A100 / H100 / H200).

`int8` and `fp8` are the dense int8 (TOPS) and fp8 peaks the same pages list, where the chip has
the units: no TPU up to v6e lists fp8 (its matmul units take bfloat16 and int8), nor does A100.

`dcn_gb_per_s`, the data-centre network between slices per chip, where published: v5p's page
lists 50 Gbps per chip; v5e's 6.4 Tbps per 256-chip pod (25 Gbps per chip). `host_gb_per_s`, the
link to host memory per chip, both directions together, where published: the NVIDIA data sheets'
PCIe figures. Where a figure is not published the planner assumes one (engine/plan/planner.py),
and its flags set them.

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
  dcn_gb_per_s: float | None = None  # GB/s per chip between slices; None: not published.
  host_gb_per_s: float | None = None  # GB/s per chip to host memory; None: not published.


CHIPS = (
    Chip('TPU v4', ('TPU v4',), {'bfloat16': 275, 'float32': 275, 'int8': 275}, 32, 1200, 300),
    Chip('TPU v5e', ('TPU v5 lite', 'TPU v5e'), {'bfloat16': 197, 'float32': 197, 'int8': 393},
         16, 819, 200, dcn_gb_per_s=3.125),
    Chip('TPU v5p', ('TPU v5p', 'TPU v5'), {'bfloat16': 459, 'float32': 459, 'int8': 918}, 95,
         2765, 600, dcn_gb_per_s=6.25),
    Chip('TPU v6e', ('TPU v6 lite', 'TPU v6e', 'TPU v6'),
         {'bfloat16': 918, 'float32': 918, 'int8': 1836}, 32, 1640, 448),
    Chip('NVIDIA A100', ('A100',), {'bfloat16': 312, 'float32': 156, 'int8': 624}, 80, 2039,
         600, host_gb_per_s=64),
    Chip('NVIDIA H100', ('H100',), {'bfloat16': 989, 'float32': 495, 'int8': 1979, 'fp8': 1979},
         80, 3350, 900, host_gb_per_s=128),
    Chip('NVIDIA H200', ('H200',), {'bfloat16': 989, 'float32': 495, 'int8': 1979, 'fp8': 1979},
         141, 4800, 900, host_gb_per_s=128),
    Chip('NVIDIA L4', ('L4',), {'bfloat16': 121, 'float32': 60, 'int8': 242, 'fp8': 242}, 24,
         300, 64, host_gb_per_s=64),
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


# Where XLA:TPU's collectives differ from the theory's (and from the CPU compile), and which
# compiles showed it (docs/benchmarks.md: the ahead-of-time TPU compiles and the Llama-3-8B
# plan; tests/commands/test_plan.py for the two slices).
TPU_NOTES = """Measured on ahead-of-time compiles (libtpu's compiler on a CPU machine, jax 0.10.2, \
libtpu 0.0.42.1) of a GPT-2-small-sized train step (12 layers, width 768, vocabulary 50304, \
sequence 1024, batch 64, bfloat16, full remat) for TPU v5p 2x2x2, the Llama-8B figure in (b) \
of a Llama-3-8B-shaped step (sequence 8192, batch 128, bfloat16, full remat) for v5p 4x4x8, \
and (f) of a GPT step on two v5p 2x2x1 slices; other compiler versions may differ. \
Reading measured / theory on TPU: the theory counts what manual mode asks for, in \
the dtypes it asks for. XLA:TPU (a) gathers FSDP weights in the compute dtype (bfloat16: \
all-gather at 0.5) and once per step (no re-gather for the backward pass); (b) turns some FSDP \
gradients' reduce-scatters (all, at GPT-2-small size; the head's float32 gradient at Llama-8B \
size) into an all-reduce of the whole gradient followed by a slice: reduce-scatter below 1, and \
an fsdp all-reduce the theory does not have, fsdp times the missing reduce-scatter bytes (in \
auto mode with data parallelism too, over data and fsdp at once); (c) in auto mode reduces \
data-parallel gradients where the weight-gradient matmuls produce them, in bfloat16 (all-reduce \
near 0.5-0.65; a tied embedding's two gradient parts reduced separately); (d) in auto FSDP \
runs most weight gathers and gradient reduce-scatters as windowed einsums (collective \
matmuls): collective-permutes of shard-sized pieces, about 9/8 of the all-gather bytes they \
replace, overlapped with the matmuls (permutes over fsdp are those). Under remat, on CPU as on \
TPU, (e) some of the forward pass's tensor-parallel all-reduces run again in the backward pass: \
tensor all-reduce about 1.2 with full remat. (f) Between slices XLA:TPU sends through the \
data-centre network (Megascale): the `dcn` rows. The theory splits each collective over an \
axis that spans slices the same way (engine/analysis/slices.py): an all-reduce over data is \
a reduce-scatter in the slice, the slice's share all-reduced between slices, and an all-gather \
in the slice."""
