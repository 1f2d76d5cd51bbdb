"""TensorBoard events (tensorboardX) under WORKDIR/tensorboard."""

from __future__ import annotations

from tensorboardX import SummaryWriter

from engine.loggers.base import Logger


class TensorBoard(Logger):
  """One scalar series per name; a resumed run's events after its checkpoint's step are purged
  (they run again)."""

  def __init__(self, workdir, start_step: int, config):
    super().__init__(workdir, start_step, config)
    self.writer = SummaryWriter(str(workdir / 'tensorboard'), purge_step=start_step + 1)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    for name, value in scalars.items():
      self.writer.add_scalar(name, value, step)

  def close(self) -> None:
    self.writer.close()
