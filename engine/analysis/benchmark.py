"""Step time, per-device memory and collectives of each parallelism mode, measured in one run.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.analysis.benchmark \
      --config=experiments/shakespeare_char.py:mesh=2x2x2 \
      --config.data.path=../shared/data/tinyshakespeare.txt --modes=auto,manual --steps=30

Both modes start from the same sharded state and see the same batches. Their steps are
interleaved (auto, manual, auto, manual, ...) so that machine noise and drift hit both alike; the
report gives the median, min and max of each and the ratio of medians.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from engine import data, parallel
from engine.analysis import collectives
from engine.metrics import log_memory, quiet_library_logs
from engine.state import TrainSetup
from engine.train import setup


@dataclasses.dataclass
class ModeRun:
  """One mode's compiled step and what was measured of it."""
  mode: str
  compiled: object
  compile_seconds: float
  memory: dict[str, int]
  collectives: list[collectives.Collective]
  step_seconds: list[float] = dataclasses.field(default_factory=list)
  losses: list[float] = dataclasses.field(default_factory=list)
  grad_norms: list[float] = dataclasses.field(default_factory=list)

  def median_ms(self) -> float:
    return 1e3 * float(np.median(self.step_seconds))


def compile_mode(train_setup: TrainSetup, mode: str, abstract_batch) -> ModeRun:
  steps = parallel.STEP_BUILDERS[mode](train_setup)
  start = time.perf_counter()
  compiled = steps.train.lower(train_setup.abstract_state(), abstract_batch).compile()
  seconds = time.perf_counter() - start
  return ModeRun(mode, compiled, seconds, log_memory(f'{mode} train step', compiled),
                 collectives.count_collectives(compiled.as_text(), train_setup.mesh))


def run_interleaved(config, corpus: data.Corpus, train_setup: TrainSetup,
                    modes: list[str], num_steps: int, warmup: int = 2,
                    observe: Callable | None = None) -> list[ModeRun]:
  """Compiles every mode, then runs their steps interleaved on the same batches.

  `corpus` and `train_setup` come from engine.train.setup(config). `observe(step, run, state,
  host_batch)` is called after each mode's step, outside the timed region (step counts from 1,
  warm-up included).
  """
  batch_sharding = train_setup.batch_sharding()
  global_batch = config.data.global_batch_size
  abstract_batch = train_setup.abstract_batch(global_batch, config.data.seq_len)
  runs = [compile_mode(train_setup, mode, abstract_batch) for mode in modes]
  states = [train_setup.init(config.seed)[0] for _ in modes]
  batches = data.windows_dataset(corpus.train_tokens, config.data.seq_len, global_batch,
                                 config.seed, jax.process_index(), jax.process_count())
  for i in range(warmup + num_steps):
    batch = data.to_global(batches[i], batch_sharding, global_batch)
    for k, run in enumerate(runs):
      start = time.perf_counter()
      states[k], metrics = run.compiled(states[k], batch)
      jax.block_until_ready((states[k], metrics))
      if i >= warmup:
        run.step_seconds.append(time.perf_counter() - start)
      run.losses.append(float(metrics['loss']))
      run.grad_norms.append(float(metrics['grad_norm']))
      if observe:
        observe(i + 1, run, states[k], batches[i])
  return runs


def report(runs: list[ModeRun], tokens_per_step: int) -> str:
  """A plain-text table: speed, memory and collectives of each mode, and the ratio of medians."""
  lines = [f'{"mode":8s} {"median ms":>10s} {"min ms":>8s} {"max ms":>8s} {"tokens/s":>10s} '
           f'{"compile s":>9s} {"args MiB":>9s} {"temp MiB":>9s}']
  for run in runs:
    t = np.array(run.step_seconds) * 1e3
    lines.append(
        f'{run.mode:8s} {np.median(t):10.2f} {t.min():8.2f} {t.max():8.2f} '
        f'{tokens_per_step / np.median(t) * 1e3:10,.0f} {run.compile_seconds:9.1f} '
        f'{run.memory.get("argument_size_in_bytes", 0) / 2**20:9.2f} '
        f'{run.memory.get("temp_size_in_bytes", 0) / 2**20:9.2f}')
  if len(runs) == 2:
    lines.append(f'ratio {runs[1].mode}/{runs[0].mode} of median step time: '
                 f'{runs[1].median_ms() / runs[0].median_ms():.3f}')
  for run in runs:
    lines.append(f'collectives per step, {run.mode}: kind, axes, ops, executions, buffers, KiB')
    for (kind, axes), row in collectives.summarize(run.collectives).items():
      lines.append(f'  {kind:18s} {",".join(axes) or "-":14s} {row["ops"]:4d} '
                   f'{row["executions"]:5d} {row["buffers"]:5d} {row["bytes"] / 1024:10.1f}')
  return '\n'.join(lines)


def main():
  """Command line; flags are defined here, not at import, so other tools can import this."""
  config_flag = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                                lock_config=True)
  modes = flags.DEFINE_list('modes', ['auto', 'manual'], 'Modes to compare, in order.')
  steps = flags.DEFINE_integer('steps', 20, 'Timed steps per mode (after 2 warm-up steps).')
  json_path = flags.DEFINE_string('json', None, 'Also write the measurements to this JSON file.')

  def run(argv):
    del argv
    quiet_library_logs()
    config = config_flag.value
    corpus, train_setup = setup(config)
    runs = run_interleaved(config, corpus, train_setup, modes.value, steps.value)
    print(report(runs, config.data.global_batch_size * config.data.seq_len))
    if json_path.value:
      with open(json_path.value, 'w') as f:
        json.dump({run.mode: {
            'step_ms': [s * 1e3 for s in run.step_seconds], 'median_ms': run.median_ms(),
            'compile_s': run.compile_seconds, 'memory': run.memory, 'losses': run.losses,
            'collectives': {f'{k}|{",".join(a)}': v
                            for (k, a), v in collectives.summarize(run.collectives).items()}}
            for run in runs}, f, indent=1)

  app.run(run)


if __name__ == '__main__':
  main()
