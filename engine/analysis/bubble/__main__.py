"""The pipeline bubble measured: step time against the number of micro-batches.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.analysis.bubble \
      --config=experiments/tiny.py:mesh=2x1x1x1x4 --config.model.num_layers=8 \
      --config.train.microbatches=4 --microbatches=4,8,12,16 --steps=10

A stage spends every iteration of the schedule computing, on a micro-batch or (in the bubble) on
nothing useful, so a step takes t(M) = c (R M + S - 1) + k for M micro-batches of a fixed size
(S stages, R = train.pipeline_repeats, k the work outside the pipeline that does not grow with
M). Each micro-batch count runs with the batch scaled to keep the micro-batch size, all counts
and modes interleaved on the same data (engine.analysis.benchmark); a least-squares line through
the median step times gives the time per micro-batch (the slope), and the measured bubble at M
is the share of the step not explained by it, 1 - slope x M / t(M): the schedule's idle
iterations plus whatever else does not scale with the batch (the optimizer update, launch
overheads). Printed beside the bubble the schedule implies, (S - 1) / (R M + S - 1) (1F1B's
is GPipe's, R = 1; interleaved 1F1B's is circular's; zb_h1's 3 (S - 1) / (4 M + 3 (S - 1)),
engine.parallel.pipeline.gpipe.bubble_fraction), and the compiled step's temporaries per device,
where the activations in flight live (train.pipeline_schedule=1f1b holds at most 2 S - 1
micro-batches' inputs per stage, interleaved_1f1b 2 R S - 1 of its chunks', zb_h1 1F1B's and
S items' projection inputs and output cotangents, GPipe and circular every micro-batch's
activations).
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from engine import config as config_lib
from engine import parallel
from engine.analysis import benchmark
from engine.assemble import assemble
from engine.cli.command_line import run_command
from engine.parallel.pipeline.gpipe import SCHEDULE_NAMES, bubble_fraction, schedule_of
from engine.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file (a mesh with '
                                          'mesh.stage > 1).', lock_config=False)
_MODES = flags.DEFINE_list('modes', ['auto', 'manual'], 'Modes to run.')
_MICROBATCHES = flags.DEFINE_list('microbatches', [], 'Micro-batch counts to time (at least '
                                  'two; default: 1, 2, 3 and 4 x train.microbatches).')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps per variant.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed first steps per variant.')


def _counts(config) -> list[int]:
  if not all(m.isdigit() and int(m) > 0 for m in _MICROBATCHES.value):
    raise ConfigError(f'--microbatches={",".join(_MICROBATCHES.value)}: give positive '
                      'integers joined by commas, e.g. --microbatches=4,8,12,16.')
  counts = [int(m) for m in _MICROBATCHES.value] or [
      k * config.train.microbatches for k in (1, 2, 3, 4)]
  if len(set(counts)) < 2:
    raise ConfigError(f'--microbatches={counts}: give at least two different counts '
                      'to fit a line through.')
  return sorted(set(counts))


def main(argv):
  del argv
  measure(_CONFIG.value)


def measure(config) -> None:
  """Times every micro-batch count in both modes and prints the table."""
  parallel.check_modes(_MODES.value, '--modes')
  benchmark.check_timing_flags(_STEPS.value, _WARMUP.value)
  if config.mesh.stage < 2:
    raise ConfigError(f'mesh.stage={config.mesh.stage}: the bubble is a pipeline\'s; '
                      'use a mesh with stage > 1 (e.g. :mesh=2x1x1x1x4).')
  counts = _counts(config)
  first = config.train.microbatches
  rows_per_micro = config.data.global_batch_size // first
  corpus, variants, sizes = None, [], []
  for count in counts:
    run = assemble(config_lib.with_values(config, {
        'train.microbatches': count, 'data.global_batch_size': rows_per_micro * count}),
                   corpus=corpus)  # Reads the data once.
    corpus = run.corpus
    variants += [(mode, run.setup) for mode in _MODES.value]
    sizes += [run.config.data.global_batch_size] * len(_MODES.value)
  # Each variant's batch is its own (sizes); the seed, data and sequence length are all's.
  runs = benchmark.run_variants(run.config, corpus, variants, _STEPS.value, _WARMUP.value,
                                batch_sizes=sizes)
  stages, repeats = run.config.mesh.stage, run.config.train.pipeline_repeats
  schedule = schedule_of(run.config.train)
  print(f'Pipeline bubble: {stages} stages, pipeline_repeats {repeats} '
        f'({SCHEDULE_NAMES[schedule]}), micro-batches of {rows_per_micro} '
        f'rows, mesh {runs[0].mesh}; median of {_STEPS.value} steps each; temp MiB: the '
        'compiled step\'s temporaries per device (activations in flight among them).\n')
  print('| mode | micro-batches | batch | step ms | implied bubble | measured bubble | temp MiB |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  slopes = []
  for mode in _MODES.value:
    mode_runs = [run for run in runs if run.mode == mode]
    slope, measured = benchmark.fit_bubble(counts, [run.median_ms() / 1e3 for run in mode_runs])
    slopes.append(f'{mode} {1e3 * slope:.2f} ms')
    for count, run, bubble in zip(counts, mode_runs, measured):
      print(f'| {mode} | {count} | {rows_per_micro * count} | {run.median_ms():.1f} | '
            f'{bubble_fraction(stages, count, repeats, schedule):.3f} | {bubble:.3f} | '
            f'{run.memory.get("temp_size_in_bytes", 0) / 2**20:.1f} |')
  print(f'\nFitted time per micro-batch: {", ".join(slopes)}.')


if __name__ == '__main__':
  run_command(main, 'engine.analysis.bubble', required=('config',))
