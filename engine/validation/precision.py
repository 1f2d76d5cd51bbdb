"""The quantized projections' keys (engine/models/quantized_matmul.py): the precision's name, and
a block size that divides every contraction each device splits into blocks, so that every mesh
and mode computes the scales one device would."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine.errors import ConfigError
from engine.models.moe.dispatch import capacity
from engine.models.quantized_matmul import PRECISIONS
from engine.validation.checks import choose


def check_matmul_precision(config: ConfigDict, mesh: dict[str, int], training: bool) -> None:
  model = config.model
  choose(model, 'matmul_precision', 'model.matmul_precision', PRECISIONS)
  if model.matmul_precision == 'default':
    return
  block = model.matmul_block
  if block <= 0:
    raise ConfigError(f'model.matmul_block={block} must be positive: the contraction elements '
                      'that share a scale (128 is the usual).')
  extents = _contractions(config, mesh, training)
  for what, size in extents.items():
    if size % block:
      fits = math.gcd(*extents.values())
      suggestion = max(d for d in range(1, min(fits, block) + 1) if fits % d == 0)
      raise ConfigError(
          f'model.matmul_block={block} does not divide {what} ({size}): each device quantizes '
          'its part of a contraction in whole blocks; give --config.model.matmul_block='
          f'{suggestion} (it divides every one), or change the sizes.')


def _contractions(config: ConfigDict, mesh: dict[str, int], training: bool) -> dict[str, int]:
  """What each device's quantized matmuls contract, forward and backward: the layer's widths
  (its output widths are the backward pass's contractions) and, for the weight gradients, the
  tokens of one sequence's contiguous piece."""
  model, tensor = config.model, mesh['tensor']
  head_dim = model.head_dim if model.get('head_dim', -1) > 0 else (
      model.embed_dim // model.num_heads)
  kv_heads = model.get('num_kv_heads', -1)
  kv_heads = kv_heads if kv_heads > 0 else model.num_heads
  extents = {
      'model.embed_dim': model.embed_dim,
      'the query heads x head size on a device': model.num_heads * head_dim // tensor,
      'the key / value heads x head size on a device': (
          kv_heads * head_dim // (tensor if kv_heads % tensor == 0 else 1)),
      'the MLP width on a device (model.mlp_dim / mesh.tensor)': model.mlp_dim // tensor,
  }
  experts = model.get('num_experts', 0)
  if experts and model.moe_shared_expert:
    extents['the shared expert width on a device'] = model.moe_shared_expert // tensor
  # Ring attention's zigzag layout holds each sequence as two pieces per device.
  length = config.data.seq_len // (mesh['context'] * (2 if mesh['context'] > 1 else 1))
  if experts and model.moe_dispatch == 'capacity':
    extents['an expert\'s width on a device'] = (model.moe_mlp_dim or model.mlp_dim) // tensor
    if training:
      extents['the slots per expert and sequence (the capacity dispatch\'s)'] = capacity(
          length, model.experts_per_token, experts, model.moe_capacity_factor)
  if training:
    extents['the tokens of a sequence piece (data.seq_len / pieces per sequence)'] = length
  return extents
