"""Weights & Biases as one of the run's loggers (`train.loggers` naming `wandb`; the `wandb` extra).

Process 0 opens one W&B run per workdir: its id is kept in WORKDIR/wandb_run.json, so a resumed
run continues the same W&B run. The project, entity, mode (online or offline, for machines
without network: `wandb sync WORKDIR/wandb/offline-run-*` uploads it later) and run name come
from `train.wandb_*`; the config is the experiment's, whole. Every scalar of metrics.jsonl is
logged against the engine's step (`step`, the charts' x axis): the steps a resumed run trains
again are logged again, with the same values, since resumes are exact.
"""

from __future__ import annotations

import json
import secrets

from etils import epath

from engine.workdir import run_dir as workdir_lib

RUN_FILE = 'wandb_run.json'


class WandbLogger:
  """One W&B run for the workdir (opened on process 0 only, by MetricsWriter)."""

  def __init__(self, workdir: epath.Path, train_config, config_dict: dict):
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

  def close(self, summary: dict | None = None) -> None:
    """Ends the W&B run; `summary` (summary.json's numbers) becomes the run's summary."""
    if summary:
      self.run.summary.update({k: v for k, v in summary.items()
                               if isinstance(v, (int, float, str))})
    self.run.finish()
