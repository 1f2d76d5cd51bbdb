"""What a train step needs (engine.validation calls `check_schedule` when training): the
pipeline schedule, and the batch split over the batch axes, the processes and the
micro-batches."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine import sharding
from engine.errors import ConfigError
from engine.models.moe.config import stacked_layers, stacked_layers_text
from engine.parallel.pipeline.gpipe import HEAD_PLACEMENTS, SCHEDULES
from engine.validation.checks import require_divisible


def check_schedule(config: ConfigDict, mesh: dict[str, int], rules: sharding.Rules,
                   num_processes: int) -> None:
  """What a train step needs: the pipeline schedule, and the batch split over the batch axes,
  the processes and the micro-batches."""
  stages, repeats = mesh['stage'], config.train.pipeline_repeats
  _check_named_schedule(config.train.get('pipeline_schedule', ''), stages, repeats,
                        config.train.microbatches)
  head = config.train.get('pipeline_head', 'split')
  if head not in HEAD_PLACEMENTS:
    raise ConfigError(f'train.pipeline_head={head!r} is unknown; choose '
                      f"{' or '.join(map(repr, HEAD_PLACEMENTS))}.")
  if repeats > 1 and stages == 1:
    raise ConfigError(
        f'train.pipeline_repeats={repeats}: the circular pipeline schedule needs mesh.stage > 1; '
        'set it to 1, or split the mesh into stages.')
  if repeats > 1 and stacked_layers(config.model) % (stages * repeats):
    raise ConfigError(
        f'{stacked_layers_text(config.model)} does not split into mesh.stage={stages} x '
        f'train.pipeline_repeats={repeats} groups of equal depth; choose counts whose product '
        'divides it.')
  if stages > 1 and config.train.microbatches < stages:
    raise ConfigError(
        f'train.microbatches={config.train.microbatches} is fewer than mesh.stage={stages}: the '
        'pipeline would never fill; give at least as many micro-batches as stages (more shrink '
        f'the idle fraction, (stages - 1) / (microbatches + stages - 1)).')
  batch_axes = rules.mesh_axes('batch', activation=True)
  batch_ways = math.prod(mesh[a] for a in batch_axes)
  global_batch = config.data.global_batch_size
  if global_batch % batch_ways:
    raise ConfigError(
        f'data.global_batch_size={global_batch} does not split over the mesh\'s '
        f'batch axes {"*".join(batch_axes)}={batch_ways}; make it a multiple of {batch_ways}, or '
        'change the mesh.')
  require_divisible(global_batch, 'data.global_batch_size', num_processes,
                    'the number of processes')
  local_batch = global_batch // batch_ways
  if local_batch % config.train.microbatches:
    raise ConfigError(
        f'train.microbatches={config.train.microbatches} does not divide the {local_batch} rows '
        f'each device holds (data.global_batch_size={global_batch} over '
        f'{batch_ways} batch shards); choose a divisor of {local_batch}, or a larger batch.')


def _check_named_schedule(schedule: str, stages: int, repeats: int, microbatches: int) -> None:
  """train.pipeline_schedule against the mesh, train.pipeline_repeats and train.microbatches
  ('' is always fine)."""
  if not schedule:
    return
  if schedule not in SCHEDULES:
    raise ConfigError(f'train.pipeline_schedule={schedule!r} is unknown; choose one of '
                      f'{", ".join(SCHEDULES)} (or leave it empty: gpipe, or circular with '
                      'train.pipeline_repeats > 1).')
  if stages == 1:
    raise ConfigError(f'train.pipeline_schedule={schedule!r} needs pipeline stages, but '
                      'mesh.stage=1; split the mesh into stages (mesh.stage > 1), or leave '
                      'train.pipeline_schedule empty.')
  grouped = {'circular': 'gpipe', 'interleaved_1f1b': '1f1b'}  # Each with its one-group form.
  if schedule in grouped and repeats == 1:
    raise ConfigError(f'train.pipeline_schedule={schedule!r} needs train.pipeline_repeats > 1 '
                      f'(the groups of layers each stage holds); set it, or choose '
                      f'{grouped[schedule]}.')
  if schedule not in grouped and repeats > 1:
    raise ConfigError(f'train.pipeline_schedule={schedule!r} runs one group of layers per '
                      f'stage, but train.pipeline_repeats={repeats}; set it to 1, or choose '
                      f'{"circular" if schedule == "gpipe" else "interleaved_1f1b"}.')
  if schedule == 'interleaved_1f1b' and microbatches % stages:
    raise ConfigError(f"train.pipeline_schedule='interleaved_1f1b' runs the micro-batches in "
                      f'groups of mesh.stage={stages}, but train.microbatches={microbatches}; '
                      f'make it a multiple of {stages}.')
