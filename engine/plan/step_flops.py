"""The FLOPs a train step executes, beyond the model's count (6N plus attention): what the
planner's roofline times at the chip's peak (engine/plan/planner.py).

The layers under full remat or a 1F1B schedule run their forward pass twice, a pipeline's stages
also compute in the bubble, the head runs once per stage unless 1F1B splits it, a mixture of
experts' dispatch may multiply padded rows, and quantized projections run at another peak.
"""

from __future__ import annotations

import math

from engine.analysis import comm_theory
from engine.models.moe.dispatch import capacity
from engine.parallel import expert_exchange
from engine.parallel.pipeline.gpipe import SELF_DIFFERENTIATING, bubble_fraction, schedule_of


def executed_flops(model_flops: float, config, train_setup=None) -> float:
  """The FLOPs a step executes for the model's `model_flops` (6N + attention). The layers:
  full remat runs every forward pass twice (8N), and so do the 1F1B schedules, whose backward
  tick runs the stage's forward pass again (with full remat too: XLA's count of the unrolled
  step shows no third), and a pipeline's stages also compute in the bubble (the schedule's
  bubble_fraction of the step). The head
  (head_flops, of the given `train_setup`) runs once for the whole batch, outside remat and the
  bubble, but on every stage of a pipeline unless 1F1B splits it over them
  (train.pipeline_head)."""
  head = head_flops(train_setup, config) if train_setup is not None else 0.0
  return (model_flops - head) * _layer_work(config) + head * head_copies(train_setup, config)


def _layer_work(config) -> float:
  """Executed FLOPs of the layers per FLOP of the model's count: full remat and the 1F1B
  schedules run the forward pass twice, and a pipeline's stages also compute in the bubble
  (the work spread over the whole step, idle ticks included)."""
  forward_passes = 2 if (config.model.remat == 'full' or config.train.get(
      'pipeline_schedule', '') in SELF_DIFFERENTIATING) else 1
  work = (4 + 2 * forward_passes) / 6
  if config.mesh.stage > 1:
    work /= 1 - bubble_fraction(config.mesh.stage, config.train.microbatches,
                                config.train.pipeline_repeats, schedule_of(config.train))
  return work


def quantized_flops(train_setup, config) -> float:
  """The executed FLOPs of the projections model.matmul_precision quantizes (6 per weight and
  token, scaled as the layers are): what runs at the chip's int8 / fp8 peak."""
  tokens = config.data.global_batch_size * config.data.seq_len
  return 6.0 * train_setup.model.quantized_params * tokens * _layer_work(config)


def head_flops(train_setup, config) -> float:
  """The output head's FLOPs per step in the model's count (6 x embed x vocab per token)."""
  model = train_setup.model
  return 6.0 * model.embed_dim * model.vocab_size * (config.data.global_batch_size *
                                                      config.data.seq_len)


def head_copies(train_setup, config) -> int:
  """How many times a step computes the head: once, or with pipeline stages once per stage
  unless 1F1B splits it over them."""
  stages = config.mesh.stage
  if train_setup is None or stages == 1:
    return 1
  mesh_shape = dict(train_setup.mesh.shape)
  local_batch = config.data.global_batch_size // math.prod(
      mesh_shape[a] for a in train_setup.rules.mesh_axes('batch', activation=True))
  return 1 if comm_theory.head_split(train_setup, local_batch, config.data.seq_len) else stages


def expert_padding_flops(train_setup, mode: str, tokens: int, seq_len: int) -> float:
  """Training FLOPs a mixture of experts multiplies beyond its k assignments per token (the
  model's FLOPs count those): the capacity dispatch's E x C slots per sequence (more than L x k
  when the factor pads, fewer when it drops); on an expert axis of n devices, auto mode's
  dropless dispatch where it gives every position a slot (C = L: E / k times the useful expert
  FLOPs), or else the dropless exchange's (expert_exchange.exchanges_dropless): none, as its
  grouped matmuls visit only the groups' rows (TPU and GPU kernels: the unused rows of the n
  blocks of min(k, E / n) rows per token cost no FLOPs, engine.bench.grouped_matmul,
  docs/benchmarks.md, though XLA's cost analysis counts them all; on CPU
  engine/models/moe/tiled_ragged_dot.py, whose last tile of a group is masked, not counted).
  Dropless on one device multiplies only the rows routed: none."""
  experts = train_setup.model.experts
  if experts is None:
    return 0.0
  E, K = experts.num_experts, experts.experts_per_token
  if experts.capacity_factor:
    slots = E * capacity(seq_len, K, E, experts.capacity_factor) / (seq_len * K)
  elif (train_setup.rules.mesh_axes('experts', activation=True) and
        not expert_exchange.exchanges_dropless(train_setup, mode)):
    slots = E / K
  else:
    return 0.0
  # Each token's k experts multiply k / E of the routed weights, 6 FLOPs per weight.
  routed = sum(math.prod(p.shape) for p in train_setup.parameters() if 'experts' in p.logical_axes)
  return 6.0 * routed * K / E * tokens * (slots - 1)
