"""The parallelism section: the mode's keys, the rules against the mesh, and what the context
and stage axes ask of the data and the model (engine.validation calls `check_parallelism`)."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine import sharding
from engine.config import DTYPES, FSDP_GATHERS, OPTIMIZER_SHARDINGS
from engine.errors import ConfigError
from engine.models.moe.config import stacked_layers, stacked_layers_text
from engine.parallel.quantized_gather import GATHER_DTYPES
from engine.validation.checks import choose


def check_parallelism(config: ConfigDict, mesh: dict[str, int]) -> sharding.Rules:
  """The rules, and what the mode, context and stage axes ask of the model."""
  parallelism = config.parallelism
  choose(parallelism, 'grad_reduce_dtype', 'parallelism.grad_reduce_dtype', DTYPES)
  choose(parallelism, 'fsdp_gather', 'parallelism.fsdp_gather', FSDP_GATHERS)
  choose(parallelism, 'optimizer_sharding', 'parallelism.optimizer_sharding',
         OPTIMIZER_SHARDINGS)
  if (parallelism.optimizer_sharding == 'zero1' and parallelism.mode == 'manual' and
      config.model.get('moe_balance', 'aux_loss') == 'aux_free' and
      config.model.get('num_experts', 0)):
    raise ConfigError(
        "parallelism.optimizer_sharding='zero1' in manual mode with model.moe_balance='aux_free' "
        'is not supported yet: the router bias moves as a whole, not by ZeRO-1 blocks; use '
        "parallelism.mode=auto, or model.moe_balance='aux_loss'.")
  if (parallelism.optimizer_sharding == 'zero1' and parallelism.mode == 'manual' and
      config.optim.name == 'muon'):
    raise ConfigError(
        "parallelism.optimizer_sharding='zero1' in manual mode with optim.name='muon' is not "
        'supported yet: Muon makes each matrix whole over the axes that split its parameter, '
        "not its ZeRO-1 blocks; use parallelism.mode=auto, or optimizer_sharding='params'.")
  if parallelism.rules not in sharding.RULE_PRESETS and parallelism.rules != 'auto':
    raise ConfigError(f'parallelism.rules={parallelism.rules!r} is unknown; choose '
                      f"'auto' or one of {sorted(sharding.RULE_PRESETS)}.")
  rules = sharding.rules_for(parallelism.rules, mesh)
  _check_gather_dtype(parallelism, mesh)
  unused = [a for a, size in mesh.items() if size > 1 and a not in rules.mesh_axes_used()]
  if unused:
    raise ConfigError(
        f'parallelism.rules={parallelism.rules!r} does not use mesh axes {unused} of size '
        '> 1, so they would only duplicate work; set them to 1 or pick rules that use them.')
  named = sharding.RULE_PRESETS.get(parallelism.rules, rules).params
  # Stages and experts are optional splits of any preset (experts exist only in a MoE model).
  splits = {a for axes in named.values() for a in axes if a not in ('stage', 'expert')}
  if splits and math.prod(mesh.values()) > 1 and not any(mesh[a] > 1 for a in splits):
    raise ConfigError(
        f'parallelism.rules={parallelism.rules!r} splits parameters over mesh '
        f'{" and ".join(sorted(splits))}, which {"is" if len(splits) == 1 else "are"} 1: every '
        f'device would hold them whole; give mesh.{" or mesh.".join(sorted(splits))} a size '
        "> 1, or set parallelism.rules='data_parallel'.")
  context = mesh['context']
  if context > 1 and config.data.seq_len % (2 * context):
    raise ConfigError(
        f'data.seq_len={config.data.seq_len} must be a multiple of 2*mesh.context={2 * context}: '
        'each device holds two of the 2*context chunks of every sequence (one early, one late, '
        'so that causal attention costs every device the same).')
  if (context > 1 and parallelism.mode == 'manual'
      and config.model.attention not in ('einsum', 'splash')):
    raise ConfigError(
        f'model.attention={config.model.attention!r} with mesh.context={context} in manual mode: '
        "ring attention computes its own blocks; set model.attention='einsum' or 'splash' (auto "
        'mode may keep it).')
  stages = mesh['stage']
  if stages > 1 and stacked_layers(config.model) % stages:
    raise ConfigError(
        f'{stacked_layers_text(config.model)} does not split into mesh.stage={stages} '
        'pipeline stages of equal depth; choose a stage count that divides it.')
  return rules


def _check_gather_dtype(parallelism: ConfigDict, mesh: dict[str, int]) -> None:
  choose(parallelism, 'gather_dtype', 'parallelism.gather_dtype', GATHER_DTYPES)
  if parallelism.gather_dtype == 'default':
    return
  if parallelism.mode != 'manual':
    raise ConfigError(
        f'parallelism.gather_dtype={parallelism.gather_dtype!r} needs parallelism.mode=manual: '
        "in auto mode the compiler picks what its gathers send (engine.compare's collectives "
        "table shows it); set it to 'default', or use manual mode.")
  if mesh['fsdp'] == 1:
    raise ConfigError(
        f'parallelism.gather_dtype={parallelism.gather_dtype!r} quantizes the FSDP weight '
        "gathers, and mesh.fsdp=1 has none; set it to 'default', or give mesh.fsdp a size > 1.")
