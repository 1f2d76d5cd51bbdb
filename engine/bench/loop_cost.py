"""The training loop's own cost per step: everything outside the compiled step (the loop's clock,
the hooks: finiteness guard, deferred metrics, goodput, the watchdog; the log line, the data
hand-off), measured as the step time of a real run (engine.train.loop.train: the medians of its
log intervals, from metrics.jsonl) against the same compiled step called back to back on batches
already on the devices, in alternating rounds of one process.

  python -m engine.bench.loop_cost --config=experiments/shakespeare_char.py --rounds=3

Each round trains --steps steps in a fresh temporary workdir (its evaluation and checkpoint at
the last step are sync points, which the run's throughput leaves out), then times the bare step
for as many steps; the cost is each round's ratio, less one, and their median (pairs within a
round share the machine's state: these 2-core machines drift by 10 % between rounds).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import jax
from absl import flags, logging
from ml_collections import config_flags

from engine import data
from engine.assemble import assemble
from engine.cli.command_line import run_command
from engine.config import with_values
from engine.errors import ConfigError
from engine.train.loop import train

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=False)
_STEPS = flags.DEFINE_integer('steps', 300, 'Steps per round, in each of the two loops.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Alternating rounds of the run and the bare step.')


def run_round(config) -> list[float]:
  """A real run's seconds per step, one per log interval after the first (which warms up)."""
  with tempfile.TemporaryDirectory() as workdir:
    train(config, workdir)
    with open(f'{workdir}/metrics.jsonl') as f:
      records = [json.loads(line) for line in f]
  return [1 / r['train/steps_per_s'] for r in records if 'train/steps_per_s' in r][1:]


def bare_round(step, state, batches) -> tuple[float, object]:
  """Seconds per step of the compiled step alone (the first call warms up), dispatched as the
  loop dispatches it: each step's loss fetched once the next is dispatched, so one step runs
  while the next waits (an unbounded queue of dispatched steps ran 10-20 % slower on CPU)."""
  state, metrics = step(state, batches[0])
  jax.block_until_ready(state)
  start = time.perf_counter()
  for batch in batches[1:]:
    state, next_metrics = step(state, batch)
    jax.device_get(metrics['loss'])
    metrics = next_metrics
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / (len(batches) - 1), state


def main(argv):
  del argv
  steps, rounds = _STEPS.value, _ROUNDS.value
  if steps < 20 or rounds < 1:
    raise ConfigError(f'--steps={steps} must be at least 20 (10 log intervals of 2 steps) and '
                      f'--rounds={rounds} at least 1.')
  config = with_values(_CONFIG.value, {
      'train.num_steps': steps, 'train.log_every': steps // 10, 'train.eval_every': steps,
      'train.checkpoint_every': steps, 'train.sample_every': 0, 'train.compile_cache_dir': 'none'})
  run = assemble(config)
  step = run.compile_train_step()
  state, _ = run.setup.init(config.seed)
  iterator = data.train_iterator(run.corpus, config.data, config.seed)
  batches = [data.to_global(next(iterator), run.setup.batch_sharding(),
                            config.data.global_batch_size) for _ in range(steps)]
  rows = []
  for index in range(rounds):
    loop = statistics.median(run_round(config))
    bare, state = bare_round(step, state, batches)
    rows.append((loop, bare))
    logging.info('Round %d: the loop %.2f ms per step, the step alone %.2f ms', index + 1,
                 1e3 * loop, 1e3 * bare)
  print(f'{jax.devices()[0].device_kind}, {len(jax.devices())} device(s), {steps} steps x '
        f'{rounds} rounds')
  print('| round | the loop, ms per step | the step alone, ms | the loop\'s own cost |')
  print('|---:|---:|---:|---:|')
  for index, (loop, bare) in enumerate(rows):
    print(f'| {index + 1} | {1e3 * loop:.2f} | {1e3 * bare:.2f} | {loop / bare - 1:+.1%} |')
  costs = sorted(loop / bare - 1 for loop, bare in rows)
  print(f'The loop\'s own cost: median {statistics.median(costs):+.1%} of the step (rounds '
        f'{costs[0]:+.1%} to {costs[-1]:+.1%}).')


if __name__ == '__main__':
  run_command(main, 'engine.bench.loop_cost', required=('config',))
