"""Validation of the train.sample_* keys (engine.validation calls `check_sample_keys`); what
depends on the tokenizer (the prompt's length) is engine/train/samples.py's."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine.errors import ConfigError

SAMPLE_TOKENS = 64  # train.sample_tokens=0: this many, or what GPT's positions leave.


def check_sample_keys(train: ConfigDict, num_processes: int) -> None:
  """The train.sample_* keys, each refused in one line naming the key and the fix."""
  if train.sample_every < 0:
    raise ConfigError(f'train.sample_every={train.sample_every} must be >= 0 (0: no samples; N: '
                      'a sample every N steps).')
  if train.sample_tokens < 0:
    raise ConfigError(f'train.sample_tokens={train.sample_tokens} must be >= 0 (0: '
                      f'{SAMPLE_TOKENS}, or what a GPT model\'s learned positions leave).')
  temperature = train.sample_temperature
  if not (math.isfinite(temperature) and temperature >= 0):
    raise ConfigError(f'train.sample_temperature={temperature} must be a finite number >= 0 '
                      '(0: greedy).')
  if train.sample_every and num_processes > 1:
    raise ConfigError(
        f'train.sample_every={train.sample_every} with {num_processes} processes: samples '
        'during training run on one process only; set it to 0 and sample the checkpoints with '
        'engine.generate.')
