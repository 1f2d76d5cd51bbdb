"""Validation of the optim section (engine.validation calls `check_optim`): Adam's constants, the
clipping norm, and a learning-rate schedule (engine/optimizer.py) whose keys agree."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine.config import DTYPES
from engine.errors import ConfigError
from engine.optimizer import NAMES, SCHEDULES


def check_optim(optim: ConfigDict) -> None:
  """Raises ConfigError naming the first bad optim key and its fix."""
  for key, choices in (('name', NAMES), ('weight_decay_on', ('matrices', 'all')),
                       ('schedule', SCHEDULES),
                       ('mu_dtype', DTYPES), ('nu_dtype', DTYPES)):
    if optim[key] not in choices:
      raise ConfigError(f'optim.{key}={optim[key]!r} is unknown; choose one of {choices}.')
  for name in ('learning_rate', 'end_learning_rate', 'weight_decay', 'b1', 'b2',
               'decay_fraction'):
    if not math.isfinite(optim[name]):
      raise ConfigError(f'optim.{name}={optim[name]} is not a finite number; give one.')
  for name in ('b1', 'b2'):
    if not 0.0 <= optim[name] < 1.0:
      raise ConfigError(f'optim.{name}={optim[name]} must lie in [0, 1): it is how much of its '
                        'running average Adam keeps each step (usual: b1=0.9, b2 from 0.95 to '
                        '0.999).')
  if not optim.grad_clip_norm > 0:
    raise ConfigError(f'optim.grad_clip_norm={optim.grad_clip_norm} must be positive: '
                      'gradients are scaled down to this global norm (inf turns clipping off).')
  if optim.weight_decay < 0:
    raise ConfigError(f'optim.weight_decay={optim.weight_decay} must be >= 0.')
  if optim.learning_rate <= 0:
    raise ConfigError(f'optim.learning_rate={optim.learning_rate} must be positive.')
  for name in ('warmup_steps', 'end_learning_rate'):
    if optim[name] < 0:
      raise ConfigError(f'optim.{name}={optim[name]} must be >= 0.')
  _check_schedule_keys(optim)
  if optim.name == 'muon':
    _check_muon_keys(optim)


def _check_muon_keys(optim: ConfigDict) -> None:
  if not (math.isfinite(optim.muon_learning_rate) and optim.muon_learning_rate > 0):
    raise ConfigError(f'optim.muon_learning_rate={optim.muon_learning_rate} must be a positive '
                      'number (usual: 0.02).')
  if not 0.0 <= optim.muon_beta < 1.0:
    raise ConfigError(f'optim.muon_beta={optim.muon_beta} must lie in [0, 1): it is how much '
                      "of its momentum Muon keeps each step (usual: 0.95).")
  if optim.muon_ns_steps < 1:
    raise ConfigError(f'optim.muon_ns_steps={optim.muon_ns_steps} must be positive: the '
                      'Newton-Schulz iterations per matrix (usual: 5).')


def _check_schedule_keys(optim: ConfigDict) -> None:
  """The decay's end and length, and no end given to a schedule that has none."""
  if optim.schedule == 'constant' and optim.decay_steps != -1:
    raise ConfigError(
        f'optim.decay_steps={optim.decay_steps} has no effect with optim.schedule=constant (it '
        'never decays); leave decay_steps at -1, or choose optim.schedule=cosine or wsd.')
  if optim.decay_steps != -1 and optim.decay_steps <= optim.warmup_steps:
    raise ConfigError(
        f'optim.decay_steps={optim.decay_steps} must exceed optim.warmup_steps='
        f'{optim.warmup_steps} (it counts the warmup), or be -1 to end at train.num_steps.')
  if not 0.0 < optim.decay_fraction <= 1.0:
    raise ConfigError(
        f'optim.decay_fraction={optim.decay_fraction} must lie in (0, 1]: it is the share of '
        'the steps that wsd spends decaying (usual: 0.1 to 0.2).')
