"""A run's start in its workdir: the workdir held by this run with its compile cache, the
checkpoint a restart resumes from (either tier), the initial state (that checkpoint, or a fresh
state with another run's or a Hugging Face checkpoint's parameters), and config.json with its
records once the run is known to start.

The training loop (engine/train/loop.py) calls these in that order, so it never reads a
checkpoint or config.json itself. `run` is the assembled run (engine.assemble.Run: its config,
setup, corpus and tokenizer).
"""

from __future__ import annotations

import contextlib
import dataclasses

from absl import logging

from engine.hf import load as hf
from engine.optimizer import schedule_end
from engine.runtime import compile_cache
from engine.workdir import checkpoint_tiers, lock
from engine.workdir import run_dir
from engine.workdir import shard_sets
from engine.workdir import tokenizer as run_tokenizer
from engine.workdir.checkpoint import Checkpointer, restore_params


@contextlib.contextmanager
def held(workdir: str, compile_cache_dir: str):
  """Yields (the workdir's path, the compile cache's counts): the workdir created if missing and
  held by this run (a second one is refused here, before it writes or compiles anything), the
  persistent compile cache in use. Call after validation: a bad config leaves no workdir."""
  path = run_dir.prepare(workdir)
  with lock.hold(path), compile_cache.use(compile_cache_dir, path) as compiled:
    yield path, compiled


@dataclasses.dataclass
class Start:
  """Where a run starts: the workdir's and the local tier's Checkpointers, and the step of the
  newest intact checkpoint of either (`tier` holds it), or None for a fresh start."""
  checkpointer: Checkpointer
  local: Checkpointer | None
  step: int | None
  tier: Checkpointer

  def close(self) -> None:
    """Closes both tiers (a run that will not train)."""
    for checkpointer in filter(None, (self.local, self.checkpointer)):
      checkpointer.close()


def find_start(run, workdir) -> Start:
  """The run's Start, once this config is known to continue the run it finds (the same on every
  process: engine/workdir/checkpoint_tiers.py)."""
  config, train_config = run.config, run.config.train
  checkpointer = Checkpointer(workdir / 'checkpoints', train_config.checkpoint_every,
                              train_config.keep_checkpoints, train_config.async_checkpoints)
  local = checkpoint_tiers.local_checkpointer(config, workdir, run.setup.abstract_state(),
                                              run.setup.mesh)
  step, tier = checkpoint_tiers.choose_resume(checkpointer, local,
                                              train_config.skip_damaged_checkpoints)
  if step is not None:
    run_dir.check_resumable(config, workdir)
    run_tokenizer.check_resumed(run.tokenizer, workdir)
    shard_sets.check_resumed(run.corpus, workdir)
    change = run_dir.layout_change(config, workdir)
    if change:
      logging.info('Resuming from step %d on another layout: %s.', step, change)
  return Start(checkpointer, local, step, tier)


def finished(config, start: Start, workdir) -> str | None:
  """The log's line for a rerun of a run whose checkpoint has reached train.num_steps (nothing
  is then compiled or written: config.json, summary.json and the loss curve stay the finished
  run's), saying how to train further; None if the run has steps to go."""
  step = start.step
  if step is None or step < config.train.num_steps:
    return None
  keep_end = ''
  if config.optim.decay_steps == -1 and config.optim.schedule != 'constant':
    # Its schedule ends at train.num_steps: a resume that moved the end would be refused.
    end = schedule_end(config.optim, config.train.num_steps)
    keep_end = (f' and --config.optim.decay_steps={end} (the {config.optim.schedule} schedule '
                f'keeps its end at step {end}; the rate stays at its end value after it)')
  return (f'The run in {workdir} is finished: its checkpoint is at step {step} '
          f'(train.num_steps={config.train.num_steps}), so nothing was trained or written. To '
          f'train further, rerun with --config.train.num_steps=M (M > {step}){keep_end}.')


def initial_state(run, start: Start, train_iterator) -> tuple:
  """(state, its step, the compiled init or None): the checkpoint of `start` (data position
  included), else a fresh sharded state with train.init_from's parameters if given."""
  config, abstract_state = run.config, run.setup.abstract_state()
  if start.step is not None:
    return start.tier.restore(start.step, abstract_state, train_iterator), start.step, None
  # Another run's parameters are checked against this model before anything compiles. They are
  # a base model's: parameters this model adds (adapters) keep their initial values.
  init_from, model = config.train.init_from, run.setup.model
  wanted = model.base_params(abstract_state['params'])
  if hf.path_of(init_from) is not None:
    params = hf.load_params(hf.path_of(init_from), wanted)
  else:
    params = restore_params(init_from, wanted) if init_from else None
  state, init_compiled = run.setup.init(config.seed)
  if params is not None:
    state['params'] = model.with_base(state['params'], params)
  return state, 0, init_compiled


def record_start(run, workdir) -> None:
  """config.json with its records, once the run is known to start. The workdir keeps the
  tokenizer, so that the finished run needs no file outside it."""
  run_dir.write_config(run.config, workdir, tokenizer=run_tokenizer.save(run.tokenizer, workdir),
                       shard_sets=shard_sets.record(run.corpus),
                       layout=run_dir.layout(run.config))
