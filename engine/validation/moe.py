"""The mixture-of-experts keys (model.num_experts and model.moe_*; engine/models/moe.py), the
expert mesh axis, and the layouts the layer does not support yet. engine.validation.validate
calls `check_moe`."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine.errors import ConfigError
from engine.models import moe


def check_moe(config: ConfigDict, mesh: dict[str, int]) -> None:
  """The MoE keys' values and the expert axis' split of them; then the meshes the layer's batch
  statistics are exact on."""
  model = config.model
  if model.num_experts < 0:
    raise ConfigError(f'model.num_experts={model.num_experts} must be >= 0; give 0 for the '
                      'dense MLP, or the number of experts.')
  if not model.num_experts:
    if mesh['expert'] > 1:  # `expert` splits the batch too, so no unused-axis check sees it.
      raise ConfigError(
          f"mesh.expert={mesh['expert']} splits a mixture of experts, but model "
          f'{model.name!r} is dense (model.num_experts=0); set mesh.expert=1 (mesh.data splits '
          'the batch), or give the llama model experts.')
    return
  if not 1 <= model.experts_per_token <= model.num_experts:
    raise ConfigError(
        f'model.experts_per_token={model.experts_per_token} must lie in [1, model.num_experts='
        f'{model.num_experts}]; route each token to at least one and at most every expert.')
  if model.num_experts % mesh['expert']:
    raise ConfigError(
        f"model.num_experts={model.num_experts} does not split over mesh.expert={mesh['expert']} "
        'devices; make mesh.expert a divisor of it (each device holds num_experts / expert '
        'experts).')
  for key, choices in (('moe_router', moe.ROUTERS), ('moe_dispatch', moe.DISPATCHES)):
    if model[key] not in choices:
      raise ConfigError(f'model.{key}={model[key]!r} is unknown; choose one of {choices}.')
  factor = model.moe_capacity_factor
  if not (math.isfinite(factor) and factor > 0):
    raise ConfigError(f'model.moe_capacity_factor={factor} must be a positive number; each '
                      'expert takes ceil(length * k / experts * factor) assignments of each sequence '
                      '(e.g. 1.25).')
  for key in ('moe_mlp_dim', 'moe_shared_expert', 'moe_aux_loss_coef', 'moe_z_loss_coef'):
    if not (math.isfinite(model[key]) and model[key] >= 0):
      raise ConfigError(f'model.{key}={model[key]} must be a number >= 0; give 0 or more.')
  _check_layout(config, mesh)


def _check_layout(config: ConfigDict, mesh: dict[str, int]) -> None:
  """The layouts that would compute something else than the one-device model: manual mode's
  capacity with context parallelism would count only this device's part of each sequence.
  Pipeline stages are fine: like micro-batches, they compute the balance loss per micro-batch
  (docs/configuration.md)."""
  # Capacity is counted per sequence; a device holding part of every sequence cannot count it.
  if (config.parallelism.mode == 'manual' and mesh['context'] > 1 and
      config.model.moe_dispatch == 'capacity'):
    raise ConfigError(
        f"model.moe_dispatch='capacity' in manual mode with mesh.context={mesh['context']} is "
        "not supported yet; use model.moe_dispatch='dropless', parallelism.mode=auto, or "
        'mesh.context=1.')
