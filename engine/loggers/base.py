"""The protocol every logger follows: where a run's scalars go."""

from __future__ import annotations

from etils import epath


class Logger:
  """One destination of a run's scalars, made on process 0 once the run starts.

  A logger is built as `Logger(workdir, start_step, config)`: the run's workdir, the step it
  starts from (what an earlier attempt logged after it runs again: drop it if the destination
  can), the experiment's whole config. The MetricsWriter (engine/train/metrics.py) calls `write`
  at every log point, `close` once the run's logging is over, before summary.json is written from
  metrics.jsonl, and `end_run` with summary.json's contents once it is. `check` runs in
  validation, before anything is written or compiled: settings this logger cannot run with are
  refused there in one ConfigError line.
  """

  @classmethod
  def check(cls, train_config) -> None:
    """Refuses train_config's settings this logger cannot run with (ConfigError)."""
    del train_config

  def __init__(self, workdir: epath.Path, start_step: int, config):
    del workdir, start_step, config

  def write(self, step: int, scalars: dict[str, float]) -> None:
    raise NotImplementedError

  def close(self) -> None:
    """The run's logging is over: everything written is where it goes."""

  def end_run(self, summary: dict | None) -> None:
    """After summary.json: `summary` is its contents (None where the run wrote none)."""
