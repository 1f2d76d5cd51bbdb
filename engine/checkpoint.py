"""Orbax checkpoints of the train state and the data iterator position, and resume.

Each checkpoint holds two items: 'state' (the sharded train state, restored straight into its
target shardings) and 'data' (the grain iterator state of every process). Orbax writes into a
temporary directory and renames it when complete, so an interrupted save never leaves a
checkpoint that looks valid; `latest_step` only ever sees finished ones.
"""

from __future__ import annotations

import os

import grain
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:

  def __init__(self, directory: str, save_every: int, keep: int):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_names=('state', 'data'),
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'data': grain.checkpoint.CheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True))
    self.save_every = save_every

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
    """Saves if `step` is a multiple of `save_every` (or `force`); returns whether it did.

    The device-to-host copy finishes before this returns, so `state` may be donated right after;
    the write to disk continues in the background.
    """
    if step % self.save_every and not force:
      return False
    saved = self.manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      data=grain.checkpoint.CheckpointSave(data_iterator)),
        force=True)
    if saved:
      logging.info('Saving checkpoint of step %d to %s', step, self.directory)
    return saved

  def restore(self, step: int, abstract_state, data_iterator):
    """Restores the state into the shardings carried by `abstract_state` and rewinds
    `data_iterator` in place to where it was at `step`."""
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                      data=grain.checkpoint.CheckpointRestore(data_iterator)))
    logging.info('Restored checkpoint of step %d from %s', step, self.directory)
    return restored['state']

  def close(self) -> None:
    """Waits for background writes to finish."""
    self.manager.wait_until_finished()
    self.manager.close()
