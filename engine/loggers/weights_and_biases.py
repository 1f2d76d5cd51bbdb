"""Weights & Biases (`train.loggers` naming `wandb`; the `wandb` extra).

Process 0 opens one W&B run per workdir: its id is kept in WORKDIR/wandb_run.json, so a resumed
run continues the same W&B run. The project, entity, mode (online or offline, for machines
without network: `wandb sync WORKDIR/wandb/offline-run-*` uploads it later) and run name come
from `train.wandb_*`; the config is the experiment's, whole. Every scalar of metrics.jsonl is
logged against the engine's step (`step`, the charts' x axis): the steps a resumed run trains
again are logged again, with the same values, since resumes are exact.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import secrets
import urllib.parse

from etils import epath

from engine.errors import ConfigError
from engine.loggers.base import Logger
from engine.workdir import run_dir as workdir_lib

RUN_FILE = 'wandb_run.json'


class WeightsAndBiases(Logger):
  """One W&B run for the workdir."""

  @classmethod
  def check(cls, train_config) -> None:
    if importlib.util.find_spec('wandb') is None:
      raise ConfigError('train.loggers names wandb, but the wandb package is not installed; '
                        'pip install -e ".[wandb]" (or pip install wandb), or leave wandb out.')
    if train_config.wandb_mode not in ('', 'online', 'offline'):
      raise ConfigError(f'train.wandb_mode={train_config.wandb_mode!r} is not a mode; pass '
                        "online, offline (no network: wandb sync uploads it later), or '' "
                        '(WANDB_MODE, else online).')
    mode = train_config.wandb_mode or os.environ.get('WANDB_MODE', 'online')
    if mode == 'online' and not _key_configured():
      raise ConfigError('train.loggers names wandb, online, but no W&B API key is configured '
                        '(WANDB_API_KEY, or `wandb login`); log in, or pass '
                        '--config.train.wandb_mode=offline to write the run for `wandb sync`.')

  def __init__(self, workdir: epath.Path, start_step: int, config):
    super().__init__(workdir, start_step, config)
    train_config, config_dict = config.train, config.to_dict()
    import wandb  # pylint: disable=g-import-not-at-top  (an extra: imported only when chosen)
    run_file = workdir / RUN_FILE
    run_id = json.loads(run_file.read_text())['id'] if run_file.exists() else None
    if run_id is None:
      run_id = secrets.token_hex(6)  # W&B run ids: letters and digits.
      workdir_lib.write_text_atomically(run_file, json.dumps({'id': run_id}) + '\n')
    directory = str(workdir) if not workdir_lib.is_remote(workdir) else None
    self.run = wandb.init(
        project=train_config.wandb_project or 'engine', entity=train_config.wandb_entity or None,
        name=train_config.wandb_name or workdir.name, mode=train_config.wandb_mode or None,
        id=run_id, resume='allow', dir=directory, config=config_dict)
    self.run.define_metric('*', step_metric='step')

  def write(self, step: int, scalars: dict[str, float]) -> None:
    self.run.log({'step': step, **scalars})

  def end_run(self, summary: dict | None) -> None:
    """Ends the W&B run; `summary` (summary.json's numbers) becomes the run's summary."""
    if summary:
      self.run.summary.update({k: v for k, v in summary.items()
                               if isinstance(v, (int, float, str))})
    self.run.finish()


def _key_configured() -> bool:
  """Whether W&B will find an API key: WANDB_API_KEY, or the netrc entry `wandb login` writes
  for its host."""
  if os.environ.get('WANDB_API_KEY'):
    return True
  host = urllib.parse.urlparse(os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai')).hostname
  try:
    return netrc.netrc(os.environ.get('NETRC')).authenticators(host) is not None
  except (FileNotFoundError, netrc.NetrcParseError):
    return False
