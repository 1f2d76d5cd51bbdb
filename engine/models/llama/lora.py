"""LoRA: low-rank adapters on a Llama-family model's projections (model.lora_rank,
model.lora_alpha, model.lora_targets), with every other parameter frozen.

A targeted projection x @ W gains x @ W + (alpha / rank) * (x @ A) @ B: A [*in, R] carries W's
input dimensions' logical axes, B [R, *out] its output dimensions', and the rank axis `lora` is
split by no rule, so the adapters are laid out, gathered and reduced by the same rules as W in
every layout and mode. A starts random, B at zero: the adapted model starts as the base model.
Targets are named as PEFT names them (q_proj, ..., down_proj), so an export can be a PEFT
adapter (engine/hf/lora_export.py) or merged into W.

The model's spec (engine/models/llama/spec.py) marks the adapters as its only trainable
parameters and as those it adds to a base checkpoint (ModelSpec.trainable, ModelSpec.added): the
engine then keeps no optimizer state for the frozen rest and never computes their gradients, and
train.init_from fills the base weights while the adapters start fresh.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from engine.models import layers, quantized_matmul
from engine.models.llama import config as llama_config

# PEFT's module name -> (the engine's weight, its input dimensions, the adapters' short name).
TARGETS = {
    'q_proj': ('w_q_DHK', 1, 'q'), 'k_proj': ('w_k_DNK', 1, 'k'), 'v_proj': ('w_v_DNK', 1, 'v'),
    'o_proj': ('w_o_HKD', 2, 'o'), 'gate_proj': ('w_gate_DF', 1, 'gate'),
    'up_proj': ('w_up_DF', 1, 'up'), 'down_proj': ('w_down_FD', 1, 'down'),
}
BY_WEIGHT = {weight: (name, in_dims, short) for name, (weight, in_dims, short) in TARGETS.items()}
RANK_AXIS = 'lora'
PREFIX = 'lora_'


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int
  alpha: float
  targets: tuple[str, ...]  # PEFT names, TARGETS' keys.

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def from_config(model_config) -> LoraConfig | None:
  if model_config.lora_rank <= 0:
    return None
  return LoraConfig(model_config.lora_rank, float(model_config.lora_alpha),
                    llama_config.lora_targets(model_config))


def adapter_names(weight: str) -> tuple[str, str]:
  short = BY_WEIGHT[weight][2]
  return f'{PREFIX}{short}_a', f'{PREFIX}{short}_b'


def is_adapter(path: str) -> bool:
  """Whether the parameter at `path` ('blocks/lora_q_a') is an adapter."""
  return path.rsplit('/', 1)[-1].startswith(PREFIX)


def add_adapters(module, cfg: LoraConfig, rngs) -> None:
  """The adapters of `module`'s targeted weights (those it has), as parameters beside them."""
  for name in cfg.targets:
    weight, in_dims, _ = TARGETS[name]
    if not hasattr(module, weight):
      continue
    base = getattr(module, weight)
    shape, axes = base.get_value().shape, tuple(base.get_metadata()['out_sharding'])
    a_name, b_name = adapter_names(weight)
    fan_in = math.prod(shape[:in_dims])
    setattr(module, a_name, layers.param(rngs, (*shape[:in_dims], cfg.rank),
                                         (*axes[:in_dims], RANK_AXIS), fan_in ** -0.5))
    setattr(module, b_name, layers.param(rngs, (cfg.rank, *shape[in_dims:]),
                                         (RANK_AXIS, *axes[in_dims:]), 0))


def project(module, weight: str, x: jax.Array, cfg: LoraConfig | None,
            precision: quantized_matmul.MatmulPrecision = quantized_matmul.DEFAULT) -> jax.Array:
  """x times `module`'s `weight` (at `precision`), plus its adapters' product when it has
  them."""
  in_dims = BY_WEIGHT[weight][1]
  y = layers.dense(x, getattr(module, weight)[...], in_dims=in_dims, precision=precision)
  a_name, b_name = adapter_names(weight)
  if cfg is None or not hasattr(module, a_name):
    return y
  a, b = getattr(module, a_name)[...], getattr(module, b_name)[...]
  low = layers.dense(x, a.astype(x.dtype), in_dims=in_dims)
  return y + (cfg.scale * layers.dense(low, b.astype(low.dtype))).astype(y.dtype)
