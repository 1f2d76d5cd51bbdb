"""Orbax checkpoints of the train state and the data iterator position, and resume.

Each checkpoint holds two items: 'state' (the sharded train state, restored straight into its
target shardings) and 'data' (the grain iterator's state, as JSON). Every process's iterator is
at the same index (local batch k of every process belongs to global step k), so one record serves
any number of processes: a checkpoint from 2 processes resumes on 1 and vice versa. Orbax writes
into a temporary directory and renames it when complete, so an interrupted save never leaves a
checkpoint that looks valid; `latest_step` only ever sees finished ones.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from absl import logging

from engine.config import ConfigError


class Checkpointer:

  def __init__(self, directory: str, save_every: int, keep: int):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_names=('state', 'data'),
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'data': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
    self.save_every = save_every

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def is_due(self, step: int, force: bool = False) -> bool:
    return force or step % self.save_every == 0

  def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
    """Saves if `step` is a multiple of `save_every` (or `force`); returns whether it did.

    The device-to-host copy finishes before this returns, so `state` may be donated right after;
    the write to disk continues in the background.
    """
    if not self.is_due(step, force):
      return False
    saved = self.manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      data=ocp.args.JsonSave(data_iterator.get_state())),
        force=True)
    if saved:
      logging.info('Saving checkpoint of step %d to %s', step, self.directory)
    return saved

  def restore(self, step: int, abstract_state, data_iterator):
    """Restores the state into the shardings carried by `abstract_state` and rewinds
    `data_iterator` in place to where it was at `step`."""
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                      data=ocp.args.JsonRestore()))
    data_iterator.set_state(restored['data'])
    logging.info('Restored checkpoint of step %d from %s', step, self.directory)
    return restored['state']

  def close(self) -> None:
    """Waits for background writes to finish."""
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(workdir: str, abstract_params):
  """The parameters of the latest checkpoint in another run's `workdir` (not its optimizer
  state), restored straight into the shardings that `abstract_params` carry: any mesh, either
  mode. Raises ConfigError naming the parameters whose shapes differ."""
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  manager = ocp.CheckpointManager(
      directory, item_names=('state',), item_handlers={'state': ocp.PyTreeCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(read_only=True))
  step = manager.latest_step()
  if step is None:
    raise ConfigError(f'train.init_from={workdir!r} holds no complete checkpoint; pass the '
                      '--workdir of a run that saved one.')
  saved = manager.item_metadata(step)['state']
  saved = getattr(saved, 'tree', saved)['params']
  wanted = dict(jax.tree_util.tree_leaves_with_path(abstract_params))
  found = dict(jax.tree_util.tree_leaves_with_path(saved))
  shape = lambda key: tuple(found[key].shape) if key in found else 'missing'
  differ = [f'{jax.tree_util.keystr(k)}: checkpoint {shape(k)}, model {tuple(v.shape)}'
            for k, v in wanted.items() if shape(k) != tuple(v.shape)]
  if differ:
    raise ConfigError(
        f'train.init_from={workdir!r}: the checkpoint of step {step} does not fit this model '
        f'({len(differ)} parameters differ: {"; ".join(differ[:5])}); use the model config of '
        'that run.')
  item = {'params': abstract_params}
  restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True)))
  manager.close()
  logging.info('Initialised the parameters from step %d of %s', step, directory)
  return restored['state']['params']
