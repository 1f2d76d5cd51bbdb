"""Two checkpoint tiers: frequent saves to fast storage on each host, and the workdir's.

With `train.local_checkpoint_dir` set, every `train.local_checkpoint_every` steps (where the
workdir's checkpoint is not due) each process saves every shard it holds into its own directory

  LOCAL/<run>/<layout>/process_<i>/<step>/      (the newest LOCAL_KEEP kept)

through Orbax with no primary host (engine/workdir/checkpoint.py, per_process): a local disk or
RAM disk writes in a fraction of a bucket's time, so a preemption or a crash loses fewer steps.
<run> is a digest of the workdir's path, so runs never read each other's; <layout> a digest of the
processes, the mesh's devices and every array's sharding, so only a start on the same layout finds
them (each process holds only its own shards). Each local checkpoint has its checksums, checked
like the workdir's.

On a restart every process lists its intact local steps, they are gathered, and the run resumes
from the newest step every process holds, if it is newer than the workdir's newest intact
checkpoint; else from the workdir's. One line says which, and why when a newer local step is not
on every process (a replaced host's disk is empty): that process's shards exist nowhere else (the
fully sharded state has no replica to copy them from), so the run falls back to the workdir, and
the local checkpoints after its step are deleted (they are trained again).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from engine.workdir.checkpoint import Checkpointer

LOCAL_KEEP = 2  # Local checkpoints kept per process.


def layout_digest(abstract_state, mesh) -> str:
  """What a local checkpoint's shards depend on: the processes, the mesh's devices in order,
  and every array's shape, dtype and partition."""
  leaves = jax.tree_util.tree_leaves_with_path(abstract_state)
  described = [(jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype),
                str(getattr(leaf.sharding, 'spec', leaf.sharding))) for path, leaf in leaves]
  facts = repr((jax.process_count(), mesh.axis_names, mesh.devices.shape,
                [int(d.id) for d in mesh.devices.flat], described))
  return hashlib.sha256(facts.encode()).hexdigest()[:12]


def local_directory(local_root: str, workdir: epath.Path, layout: str) -> epath.Path:
  """This process's directory of the local tier."""
  run = hashlib.sha256(str(workdir).encode()).hexdigest()[:12]
  return epath.Path(local_root).expanduser().absolute() / run / layout / (
      f'process_{jax.process_index()}')


def local_checkpointer(config, workdir: epath.Path, abstract_state, mesh) -> Checkpointer | None:
  """The local tier's Checkpointer (None when train.local_checkpoint_dir is '')."""
  train = config.train
  if not train.local_checkpoint_dir:
    return None
  directory = local_directory(train.local_checkpoint_dir, workdir,
                              layout_digest(abstract_state, mesh))
  return Checkpointer(directory, train.local_checkpoint_every, LOCAL_KEEP,
                      train.async_checkpoints, per_process=True)


def choose_resume(persistent: Checkpointer, local: Checkpointer | None,
                  skip_damaged: bool) -> tuple[int | None, Checkpointer]:
  """The step to resume from and the tier that holds it, the same on every process (module
  docstring); one log line when the local tier has a say."""
  step = persistent.choose_resume_step(skip_damaged)
  if local is None:
    return step, persistent
  mine = local.intact_steps()[:LOCAL_KEEP + 1]
  padded = np.full(LOCAL_KEEP + 1, -1, np.int64)
  padded[:len(mine)] = mine
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1, LOCAL_KEEP + 1)
  held = [set(int(s) for s in row if s >= 0) for row in gathered]
  common = max(set.intersection(*held), default=None)
  newest_anywhere = max((max(h) for h in held if h), default=None)
  persistent_step = -1 if step is None else step
  if common is not None and common > persistent_step:
    logging.info('Resuming from step %d of the local tier (%s); the workdir\'s newest checkpoint '
                 'is %s.', common, local.directory.parent.parent,
                 'none' if step is None else f'step {step}')
    local.discard_after(common)  # Damaged newer ones, or some process's newer ones.
    return common, local
  if newest_anywhere is not None and newest_anywhere > persistent_step:
    lacking = [i for i, h in enumerate(held) if newest_anywhere not in h]
    logging.warning(
        'Resuming from %s: the local tier\'s step %d is not on process%s %s (%s local '
        'checkpoints are missing or damaged: a replaced host?), and its shards are nowhere else.',
        'the workdir\'s checkpoint of step %d' % step if step is not None else 'the start',
        newest_anywhere, 'es' if len(lacking) > 1 else '', ', '.join(map(str, lacking)),
        'their' if len(lacking) > 1 else 'its')
  local.discard_after(step)  # The steps after it are trained, and saved, again.
  return step, persistent
