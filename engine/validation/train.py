"""The train section: counts and intervals, the steps that are not finite, the run to start
from and the profiled steps (engine.validation calls `check_train`; the samples' keys:
engine/validation/samples.py)."""

from __future__ import annotations

import os

from ml_collections import ConfigDict

from engine import loggers
from engine.config import parse_profile_steps
from engine.errors import ConfigError
from engine.validation.checks import require_positive


def _check_init_from(workdir: str) -> None:
  """train.init_from must be the workdir of a run that saved a complete checkpoint: Orbax names
  finished checkpoints by their step and unfinished ones with a temporary suffix."""
  if '://' in workdir:
    return  # A bucket: checked when the parameters are restored.
  if workdir.startswith('hf:'):  # A Hugging Face checkpoint (engine/hf/load.py).
    if not os.path.isfile(os.path.join(workdir[3:], 'config.json')):
      raise ConfigError(f'train.init_from={workdir!r}: no config.json in {workdir[3:]!r}; pass '
                        'hf:DIR with a Hugging Face checkpoint (config.json and *.safetensors).')
    return
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    raise ConfigError(
        f'train.init_from={workdir!r} has no checkpoints/ directory; pass the --workdir of a run '
        'that saved a checkpoint.')
  if not any(name.isdigit() for name in os.listdir(directory)):
    raise ConfigError(
        f'train.init_from={workdir!r} holds no complete checkpoint; pass the --workdir of a run '
        'that saved one.')


def check_train(train: ConfigDict) -> None:
  if train.skip_nonfinite_steps < 0:
    raise ConfigError(f'train.skip_nonfinite_steps={train.skip_nonfinite_steps} must be '
                      '>= 0: 0 stops at the first step that is not finite, N > 0 skips up to N '
                      'in a row.')
  require_positive(train, 'train', ['num_steps', 'log_every', 'eval_every', 'eval_batches',
                                    'checkpoint_every', 'keep_checkpoints', 'microbatches',
                                    'local_checkpoint_every',
                                    'pipeline_repeats'])
  if train.init_from:
    _check_init_from(train.init_from)
  for key, meaning in (('hang_timeout_s', 'seconds a step may take'),
                       ('straggler_factor', 'times the median host time of the other processes')):
    if not train[key] >= 0:  # NaN too.
      raise ConfigError(f'train.{key}={train[key]} must be >= 0 ({meaning}; 0 turns the check '
                        'off).')
  if 0 < train.straggler_factor <= 1:
    raise ConfigError(f'train.straggler_factor={train.straggler_factor} would name a process '
                      'no slower than the others; pass a factor above 1 (e.g. 2), or 0 for no '
                      'straggler warnings.')
  if '://' in train.local_checkpoint_dir:
    raise ConfigError(f'train.local_checkpoint_dir={train.local_checkpoint_dir!r} is not on this '
                      'host: the local tier is fast storage of each host (a local disk or RAM '
                      'disk); pass such a path, or leave the bucket to --workdir.')
  cache = train.compile_cache_dir
  if cache and '://' not in cache and os.path.exists(cache) and not os.path.isdir(cache):
    raise ConfigError(f'train.compile_cache_dir={cache!r} is a file; pass a directory for the '
                      "compiled programs, '' for WORKDIR/compile_cache, or 'none' for no cache.")
  parse_profile_steps(train.profile_steps, train.num_steps)
  loggers.check(train)
