"""Where a run's scalars go: `train.loggers` names any of LOGGERS, comma-separated (jsonl always:
metrics.jsonl is the run's record). Each logger follows one small protocol (base.py); the next
one is a module here and one line in LOGGERS.

  base.py                Logger: check, write, close, end_run
  json_lines.py          WORKDIR/metrics.jsonl
  tensorboard_events.py  TensorBoard events under WORKDIR/tensorboard
  weights_and_biases.py  Weights & Biases (the wandb extra), one W&B run per workdir

engine/train/metrics.py's MetricsWriter computes the scalars and hands them to every logger.
"""

from __future__ import annotations

from engine.errors import ConfigError
from engine.loggers import json_lines, tensorboard_events, weights_and_biases
from engine.loggers.base import Logger

# train.loggers' names -> their Logger classes.
LOGGERS: dict[str, type[Logger]] = {
    'jsonl': json_lines.JsonLines,
    'tensorboard': tensorboard_events.TensorBoard,
    'wandb': weights_and_biases.WeightsAndBiases,
}
RECORD = 'jsonl'  # The one every list must name.


def names(text: str) -> tuple[str, ...]:
  """train.loggers' names; ConfigError for an unknown one, or a list without jsonl."""
  chosen = tuple(name.strip() for name in text.split(',') if name.strip())
  unknown = [name for name in chosen if name not in LOGGERS]
  if unknown:
    raise ConfigError(f'train.loggers={text!r}: {unknown[0]!r} is not a logger; name any of '
                      f'{", ".join(sorted(LOGGERS))}, comma-separated (e.g. '
                      'tensorboard,jsonl,wandb).')
  if RECORD not in chosen:
    raise ConfigError(f'train.loggers={text!r} leaves out {RECORD}: metrics.jsonl is the run\'s '
                      'record (summary.json and sweeps read it); keep jsonl in the list, e.g. '
                      f'{",".join(chosen + (RECORD,))}.')
  return chosen


def check(train_config) -> None:
  """train.loggers' names, and each chosen logger's own settings (validation calls this)."""
  for name in names(train_config.loggers):
    LOGGERS[name].check(train_config)


def open_loggers(config, workdir, start_step: int) -> list[Logger]:
  """The run's loggers, in train.loggers' order (process 0's: only it writes)."""
  return [LOGGERS[name](workdir, start_step, config) for name in names(config.train.loggers)]
