"""Orbax checkpoints of the train state and the data iterator position, checked on restore.

Each checkpoint holds two items: 'state' (the sharded train state, restored straight into its
target shardings) and 'data' (the grain iterator's state, as JSON). Every process's iterator is
at the same index (local batch k of every process belongs to global step k), so one record serves
any number of processes: a checkpoint from 2 processes resumes on 1 and vice versa.

Saves are asynchronous: the loop waits only for the device-to-host copy; the files are written
in the background. Orbax writes into a temporary directory and renames it when complete, so an
interrupted save never leaves a checkpoint that looks valid. Just before that rename, process 0
records the size and CRC-32 of every file of the checkpoint in `checksums.json` (in the
background too; engine/workdir/checksums.py), so damage done later (a truncated, deleted or altered
file, arrays or metadata) is found on restore and reported by step and cause, instead of a library
traceback or, worse, silently wrong numbers.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import multihost

from engine.distributed import startup as distributed
from engine.workdir import run_dir as workdir_lib
from engine.workdir.checksums import CHECKSUMS_FILE, file_checksums, find_damage
from engine.errors import DISK_FULL, CheckpointError, ConfigError, is_disk_full

DAMAGED_DIR = 'damaged_checkpoints'  # Beside checkpoints/, where damaged ones are moved aside.
_TMP_SUFFIX = '.orbax-checkpoint-tmp'  # Orbax's temporary step directories end with this.


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return f'{type(error).__name__}: {text.splitlines()[0] if text else ""}'


def _per_process_handling():
  """Orbax's options and handlers for a directory each process writes alone (the local tier,
  engine/workdir/checkpoint_tiers.py): no primary host, and every shard a process holds written,
  replicas too, so that each process restores from its own directory."""
  options = ocp.options.MultiprocessingOptions(primary_host=None, barrier_sync_key_prefix='local')
  arrays = ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                          use_replica_parallel=False)
  registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
  handlers = {'state': ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True,
                                                   multiprocessing_options=options,
                                                   type_handler_registry=registry),
              'data': ocp.JsonCheckpointHandler(multiprocessing_options=options)}
  return options, handlers


class Checkpointer:
  """The checkpoints of one directory. `per_process`: each process saves into and restores from
  its own directory, every shard it holds (the local tier); else one directory all processes
  share (the workdir's)."""

  def __init__(self, directory: str | epath.Path, save_every: int, keep: int,
               asynchronous: bool = True, per_process: bool = False):
    self.directory = workdir_lib.resolve(directory)
    self.per_process = per_process
    self.save_every = save_every
    self._saving_step = None  # The step whose save is in flight.
    self._closed = False
    self._made = False  # Whether save() made sure the directory exists.
    self.blocked_s: list[float] = []  # Per save: how long the loop waited for it.
    self.asynchronous = asynchronous
    if asynchronous:
      barrier = {}
      if jax.process_count() > 1:
        self._orbax_barrier = multihost.get_barrier_sync_fn()
        barrier = dict(barrier_sync_fn=self._barrier)
      when = dict(async_options=ocp.AsyncOptions(post_finalization_callback=self._record_checksums,
                                                 **barrier))
    else:  # For measuring what asynchronous saving saves; checksums follow the rename.
      when = dict(enable_async_checkpointing=False)
    handlers = {'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler()}
    if per_process:
      options, handlers = _per_process_handling()
      when.update(multiprocessing_options=options, enable_per_process_directory_creation=True,
                  save_root_metadata=False)
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_names=('state', 'data'),
        item_handlers=handlers,
        # Not created here: a run that stops before its first save (bad input found late, such
        # as a damaged train.init_from) leaves no checkpoints/ behind; save() creates it.
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=False,
                                             cleanup_tmp_directories=True, **when))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def is_due(self, step: int, force: bool = False) -> bool:
    return force or step % self.save_every == 0

  def save(self, step: int, state, data_iterator, force: bool = False) -> bool:
    """Saves if `step` is a multiple of `save_every` (or `force`); returns whether it did.

    Returns once the arrays are copied to the host, so `state` may be donated right after; the
    write to disk continues in the background. Raises CheckpointError if this save or the
    previous one failed."""
    if not self.is_due(step, force):
      return False
    start = time.perf_counter()
    self._finish()  # Orbax would wait for the previous save anyway; this reports its failure.
    self._saving_step = step
    try:
      if not self._made:  # Each process makes it (exist_ok): no barrier needed.
        self.directory.mkdir(parents=True, exist_ok=True)
        self._made = True
      save = ocp.args.PyTreeSave if self.per_process else ocp.args.StandardSave
      saved = self.manager.save(
          step, args=ocp.args.Composite(state=save(state),
                                        data=ocp.args.JsonSave(data_iterator.get_state())),
          force=True)
      if saved and not self.asynchronous and (self.per_process or jax.process_index() == 0):
        self._record_checksums()
    except Exception as error:  # pylint: disable=broad-except
      raise self._failed(step, error) from error
    self.blocked_s.append(time.perf_counter() - start)
    if saved:
      logging.info('Saving checkpoint of step %d to %s (the loop waited %.0f ms)', step,
                   self.directory, 1e3 * self.blocked_s[-1])
    return saved

  def _record_checksums(self) -> None:
    """Orbax calls this on process 0 (on every process, for its own directory, per_process) once
    every process has written the step, just before the temporary directory is renamed: the
    checksums land atomically with the checkpoint."""
    step = self._saving_step
    candidates = sorted(self.directory.glob(f'{step}{_TMP_SUFFIX}*'))
    target = candidates[-1] if candidates else self.directory / str(step)  # gs:// writes in place.
    sums = file_checksums(target)
    (target / CHECKSUMS_FILE).write_text(json.dumps(sums))

  def _barrier(self, *, key: str, timeout_ms: int) -> None:
    """Orbax's barriers in its background save threads (several processes only).

    When a process's background save fails, Orbax skips the barriers that follow the writes and
    goes straight to its last one (from a `finally`, the exception still propagating), where it
    would wait for the other processes forever while they wait for it at an earlier one. Here
    that failure ends the run on every process at once (engine.distributed.startup.fail_run)."""
    error = sys.exc_info()[1]
    if error is not None and threading.current_thread() is not threading.main_thread():
      try:
        message = str(self._failed(self._saving_step, error))
      except Exception:  # pylint: disable=broad-except  (the report must go out regardless)
        message = f'Saving a checkpoint to {self.directory} failed: {_first_line(error)}.'
      distributed.fail_run(message, 1)
    self._orbax_barrier(key=key, timeout_ms=timeout_ms)

  def _finish(self) -> None:
    """Waits for the save in flight; a failure becomes one CheckpointError."""
    if self._saving_step is None:
      return
    step = self._saving_step
    try:
      self.manager.wait_until_finished()
      self.manager.check_for_errors()
    except Exception as error:  # pylint: disable=broad-except
      raise self._failed(step, error) from error
    self._saving_step = None

  def _failed(self, step: int, error: BaseException) -> CheckpointError:
    """Removes what the failed save of `step` left and says what happened, in one message."""
    self._saving_step = None
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
      cause = cause.__cause__ or cause.__context__
    # Before the partial files go: removing them frees the space that ran out.
    disk_full = is_disk_full(cause, self.directory)
    removed = 'Its partial files were removed'
    if jax.process_index() != 0 and not self.per_process:
      removed = 'Its partial files are removed when the run resumes'
    elif not _remove_partial(self.directory, step):
      removed = 'Its partial files could not all be removed yet (the next run removes them)'
    latest = max((s for s in self.manager.all_steps() if s < step), default=None)
    kept = (f'the newest complete checkpoint is step {latest}' if latest is not None else
            'no complete checkpoint exists yet')
    if disk_full:
      return CheckpointError(
          f'Saving the checkpoint of step {step} to {self.directory} failed: {DISK_FULL}. '
          f'{removed} and {kept}. Free space there, then rerun the same command to resume; or '
          'rerun with another --workdir.')
    return CheckpointError(
        f'Saving the checkpoint of step {step} to {self.directory} failed: '
        f'{_first_line(cause)}. {removed} and {kept}. Check the free space and permissions of '
        'the workdir, then rerun the same command to resume.')

  def restore(self, step: int, abstract_state, data_iterator):
    """Restores the state into the shardings carried by `abstract_state` and rewinds
    `data_iterator` in place to where it was at `step`."""
    state = (ocp.args.PyTreeRestore(item=abstract_state,
                                    restore_args=ocp.checkpoint_utils.construct_restore_args(
                                        abstract_state))
             if self.per_process else ocp.args.StandardRestore(abstract_state))
    try:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(state=state, data=ocp.args.JsonRestore()))
    except Exception as error:  # pylint: disable=broad-except
      raise CheckpointError(
          f'The checkpoint of step {step} in {self.directory} could not be restored into this '
          f'model: {_first_line(error)}. If its config.json is gone, this model config may not be '
          'the one it was trained with: resume with that config, or use a new --workdir.'
          ) from error
    data_iterator.set_state(restored['data'])
    logging.info('Restored checkpoint of step %d from %s', step, self.directory)
    return restored['state']

  def choose_resume_step(self, skip_damaged: bool) -> int | None:
    """The step to resume from, the same on every process (process 0 checks the files).

    The newest checkpoint must be intact. If it is damaged, the run stops naming the step and the
    cause, unless `skip_damaged`: then damaged checkpoints are moved to damaged_checkpoints/
    beside this directory (kept, not deleted) and the newest intact one is used."""
    message = ''
    if jax.process_index() == 0:
      chosen, message = self._check_steps(skip_damaged)
    else:
      chosen = None
    chosen = int(multihost_utils.broadcast_one_to_all(
        np.int32(-2 if message else (-1 if chosen is None else chosen))))
    if chosen == -2:
      raise CheckpointError(message if message else
                            f'The newest checkpoint in {self.directory} is damaged (process 0 '
                            'has the details).')
    if skip_damaged:
      multihost_utils.sync_global_devices('checkpoints checked')
      self.manager.reload()
    return None if chosen == -1 else chosen

  def _check_steps(self, skip_damaged: bool) -> tuple[int | None, str]:
    damaged = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      start = time.perf_counter()
      cause = find_damage(self.directory / str(step))
      if cause is None:
        logging.info('The checkpoint of step %d matches its checksums (checked in %.1f s)', step,
                     time.perf_counter() - start)
        break
      damaged.append((step, cause))
    else:
      step = None
    if not damaged:
      return step, ''
    newest, cause = damaged[0]
    fallback = (f'the newest intact one is step {step}: rerun with '
                '--config.train.skip_damaged_checkpoints=true to resume from it' if step is not None
                else 'no intact checkpoint remains: rerun with '
                '--config.train.skip_damaged_checkpoints=true to start afresh')
    if not skip_damaged:
      return None, (
          f'The checkpoint of step {newest} in {self.directory} is damaged: {cause}. Nothing was '
          f'changed; {fallback} (damaged checkpoints are then moved to '
          f'{self.directory.parent / DAMAGED_DIR}), or put back an intact copy of its files.')
    aside = self.directory.parent / DAMAGED_DIR
    aside.mkdir(parents=True, exist_ok=True)
    for bad_step, bad_cause in damaged:
      target = aside / f'{bad_step}.{int(time.time())}'
      (self.directory / str(bad_step)).rename(target)
      logging.warning('The checkpoint of step %d is damaged (%s); moved it to %s.', bad_step,
                      bad_cause, target)
    logging.warning('Resuming from step %s, the newest intact checkpoint.', step)
    return step, ''

  def intact_steps(self) -> list[int]:
    """This directory's steps whose files match their checksums, newest first (a damaged one
    is named in a warning and left alone)."""
    intact = []
    for step in sorted(self.manager.all_steps(), reverse=True):
      cause = find_damage(self.directory / str(step))
      if cause is None:
        intact.append(int(step))
      else:
        logging.warning('The checkpoint of step %d in %s is damaged (%s); it is not resumed from.',
                        step, self.directory, cause)
    return intact

  def discard_after(self, step: int | None) -> None:
    """Deletes this directory's checkpoints after `step` (None: all), which a run resuming from
    `step` will write again (the local tier's, when the run falls back to the workdir's)."""
    newer = [s for s in self.manager.all_steps() if step is None or s > step]
    for each in newer:  # Each process its own directory's (Orbax's delete syncs the processes).
      (self.directory / str(each)).rmtree()
    if newer:
      self.manager.reload()
      logging.info('Deleted the checkpoints of steps %s in %s: they are trained again.',
                   ', '.join(map(str, sorted(newer))), self.directory)

  def close(self) -> None:
    """Waits for background writes to finish (raises CheckpointError if the last failed)."""
    if self._closed:
      return
    self._closed = True
    try:
      self._finish()
    finally:
      self.manager.close()


def _remove_partial(directory: epath.Path, step: int, attempts: int = 20) -> bool:
  """Removes the temporary directory of a failed save of `step`. Writes of the failed save may
  still be landing in it for a moment, so removal is retried; Orbax removes whatever is left when
  the next run starts (cleanup_tmp_directories)."""
  quiet_checks = 0
  for _ in range(attempts):
    leftovers = list(directory.glob(f'{step}{_TMP_SUFFIX}*'))
    quiet_checks = 0 if leftovers else quiet_checks + 1
    if quiet_checks == 2:  # Gone, and nothing late recreated it.
      return True
    try:
      for leftover in leftovers:
        leftover.rmtree()
    except OSError:
      pass  # A write still landing: try again.
    time.sleep(0.1)
  return False


def _read_only_manager(directory: epath.Path) -> ocp.CheckpointManager:
  """A manager that only reads `directory`'s checkpoints. It knows both items, so that Orbax does
  not warn that the one left unread ('data') "could not be restored"; and its options are already
  those of a reader, so that Orbax does not warn that it reset them (create, save interval)."""
  return ocp.CheckpointManager(
      directory, item_names=('state', 'data'),
      item_handlers={'state': ocp.PyTreeCheckpointHandler(), 'data': ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0))


def latest_complete_step(directory: str | epath.Path) -> int | None:
  """The newest complete checkpoint in `directory`, read without touching it: unlike a
  Checkpointer, this leaves the temporary directories of unfinished saves alone, so it may look
  at a workdir that a run is about to resume (or is writing) in the same process."""
  manager = _read_only_manager(workdir_lib.resolve(directory))
  try:
    return manager.latest_step()
  finally:
    manager.close()


def restore_params(workdir: str, abstract_params):
  """The parameters of the latest checkpoint in another run's `workdir` (not its optimizer
  state), restored straight into the shardings that `abstract_params` carry: any mesh, either
  mode. Raises ConfigError naming the parameters whose shapes differ."""
  directory = workdir_lib.resolve(workdir) / 'checkpoints'
  manager = _read_only_manager(directory)
  step = manager.latest_step()
  if step is None:
    raise ConfigError(f'train.init_from={workdir!r} holds no complete checkpoint; pass the '
                      '--workdir of a run that saved one.')
  cause = find_damage(directory / str(step))
  if cause is not None:
    raise CheckpointError(f'train.init_from={workdir!r}: the checkpoint of step {step} is '
                          f'damaged: {cause}; put back an intact copy of its files, or pass '
                          'another run\'s --workdir as train.init_from.')
  saved = manager.item_metadata(step)['state']
  saved = getattr(saved, 'tree', saved)['params']
  wanted = dict(jax.tree_util.tree_leaves_with_path(abstract_params))
  found = dict(jax.tree_util.tree_leaves_with_path(saved))
  shape = lambda key: tuple(found[key].shape) if key in found else 'missing'
  extra = [k for k in found if k not in wanted]
  if extra:
    raise ConfigError(
        f'train.init_from={workdir!r}: its checkpoint of step {step} holds parameters this model '
        f'does not have ({jax.tree_util.keystr(extra[0])}, ...), which this run would drop; use '
        'the model config of that run, or for a run with adapters export it merged (python -m '
        f'engine.export --workdir={workdir} --out=DIR) and start from train.init_from=hf:DIR.')
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
