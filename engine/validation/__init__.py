"""The one validation pass over a config, before anything compiles or is written.

`validate` checks the whole tree (engine/config.py's schema), one module per config section
(model, data, optim, train, mesh, parallelism; then the train step's schedule and the model
sizes the mesh splits), and raises `ConfigError` naming the key and the fix; engine.assemble
calls it for every command before anything touches a device. The keys a model declares itself
are checked by that model (engine/models/__init__.py: MODEL_CHECKS, through model.py).
`check_layout` checks the laid-out model once its shapes are known.

  checks.py       the one wording of the small checks (positive, divisible, one of, ...)
  model.py        the model section: shared keys, the model's own check, the mesh's splits
  data.py         the data section: source, files, tokenizer, split, sequence length
  optim.py        the optimizer and its schedule
  train.py        the train section: counts, intervals, train.init_from, profiled steps
  samples.py      the training loop's text samples
  mesh.py         the mesh's sizes over the devices, hosts and slices (and count_slices)
  parallelism.py  the rules against the mesh, and what context and stage ask of the model
  attention.py    the attention kernel's keys (splash's block sizes and lengths)
  moe.py          a mixture of experts against the mesh and the mode
  schedule.py     what a train step needs: the pipeline schedule and the batch's split
  layout.py       check_layout: every parameter's split, once the model is laid out
  precision.py    quantized projections: the precision, and a block that divides each contraction
"""

from __future__ import annotations

import ml_collections

from engine import models, parallel
from engine.cli import config_help
from engine.errors import ConfigError
from engine.validation.attention import check_splash, check_window
from engine.validation.data import check_data
from engine.validation.layout import check_layout
from engine.validation.mesh import check_mesh, count_slices
from engine.validation.model import (check_loss_chunks, check_model, check_model_keys,
                                     check_model_splits, check_offload_platform)
from engine.validation.moe import check_moe
from engine.validation.optim import check_optim
from engine.validation.parallelism import check_parallelism
from engine.validation.samples import check_sample_keys
from engine.validation.precision import check_matmul_precision
from engine.validation.schedule import check_schedule
from engine.validation.train import check_train

__all__ = ['validate', 'check_layout', 'count_slices']

_MAX_SEED = 2**32 - 2


def validate(config: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1,
             num_slices: int = 1, training: bool = True, reads_text: bool = True,
             platform: str = '') -> ml_collections.ConfigDict:
  """Checks the whole config, section by section; returns it unchanged or raises ConfigError
  naming key and fix. `num_slices` > 1 (several TPU slices): the dcn axes split the mesh by
  slice, not by process. `training=False` (a finished run laid out for generation or export)
  skips what only a train step needs: the batch's split and the pipeline schedule;
  `reads_text=False` (a command that reads no text: only the vocabulary of a subword or byte
  tokenizer, such as engine.plan, or a finished run's kept tokenizer) does not ask for
  data.path's file; `platform` (the devices', e.g. 'cpu') tailors the fix a mesh too
  large for them gets."""
  config_help.check_known_keys(config)
  if config.model.name not in models.MODELS:
    raise ConfigError(f'model.name={config.model.name!r} is unknown; choose one of '
                      f'{sorted(models.MODELS)}.')
  parallel.check_modes(config.parallelism.mode)
  check_model(config.model)
  check_offload_platform(config, platform)
  check_data(config.data, config.model, reads_text)
  check_optim(config.optim)
  if config.model.get('lora_rank', 0) > 0 and config.optim.name != 'adamw':
    raise ConfigError(f'model.lora_rank={config.model.lora_rank} trains its adapters with AdamW; '
                      f'optim.name={config.optim.name!r} is not supported with LoRA: pass '
                      '--config.optim.name=adamw.')
  check_train(config.train)
  check_sample_keys(config.train, num_processes if training else 1)  # Samples only in training.
  if not 0 <= config.seed <= _MAX_SEED:
    raise ConfigError(f'seed={config.seed} must lie in [0, {_MAX_SEED}]: the data order is '
                      'shuffled with 32-bit seeds (evaluation uses seed + 1); give e.g. '
                      '--config.seed=0.')
  mesh = check_mesh(config.mesh, num_devices, num_processes, num_slices, platform)
  check_splash(config, mesh)  # Before the context checks: their fix would not apply.
  check_window(config, mesh)
  rules = check_parallelism(config, mesh)
  check_model_keys(config.model, mesh)  # The model's own keys (a MoE's experts on the mesh).
  check_moe(config, mesh)
  if training:
    check_schedule(config, mesh, rules, num_processes)
  check_model_splits(config.model, mesh)
  check_loss_chunks(config, mesh)
  check_matmul_precision(config, mesh, training)
  return config

