"""The other checkout's steps for `python -m engine.bench --baseline=DIR`, in a child process.

engine/bench/baseline.py runs this file by its path with PYTHONPATH=DIR and cwd=DIR, so that
`import engine` below is DIR's engine: this script imports nothing else of the tree it lies in,
and only the pieces of the engine that every checkout since the bench's interleaved rounds has
(engine.assemble, engine.parallel.STEP_BUILDERS, engine.config, engine.data). Each variant is
built exactly as engine.analysis.benchmark.run_variants builds it (same config, mesh, mode,
seed and batches), so that the two trees' steps differ only by their code.

Protocol, one line each way (JSON unless said):
  parent: {"config": CONFIG_JSON, "meshes": [mesh strings, '' = the config's own], "modes": [...]}
  child:  `ready` and JSON {"variants": [{"mode", "mesh_index", "compile_s", "memory", "hlo"}]}
          on the same line, after compiling every (mesh, mode), meshes outer
  parent: `step`; child: {"step_ms": [...], "loss": [...]}, one step of every variant on the
          next batch (the i-th `step` takes the i-th batch of data.batches, as the parent does)
  parent: `quit` (or end of input); the child exits with status 0.
Anything else the child or the engine prints goes to stderr; stdout carries only the protocol.
"""

import json
import os
import sys
import time

# Running a file puts its directory first on sys.path; modules there must not shadow others.
sys.path = [p for p in sys.path if os.path.abspath(p or '.') != os.path.dirname(
    os.path.abspath(__file__))]

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import ml_collections  # pylint: disable=g-import-not-at-top,wrong-import-position

from engine import config as config_lib  # pylint: disable=g-import-not-at-top
from engine import data, parallel  # pylint: disable=g-import-not-at-top
from engine.assemble import assemble, compile_train_step  # pylint: disable=g-import-not-at-top

MEMORY_FIELDS = ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes',
                 'alias_size_in_bytes', 'generated_code_size_in_bytes')


def overlay(target: ml_collections.ConfigDict, values: dict) -> None:
  """`values` (the parent's config) over this engine's defaults: keys this engine lacks are
  dropped (a newer tree's keys), lists become tuples where the default is one."""
  for key, value in values.items():
    if key not in target:
      print(f'baseline: config key {key} is unknown to this checkout; left out', file=sys.stderr)
    elif isinstance(target[key], ml_collections.ConfigDict) and isinstance(value, dict):
      overlay(target[key], value)
    else:
      target[key] = tuple(value) if isinstance(target[key], tuple) else value


def memory_of(compiled) -> dict:
  """Per-device memory as engine.train.metrics.log_memory gives it (peak: arguments + outputs +
  temporaries - aliased)."""
  stats = compiled.memory_analysis()
  if not stats:
    return {}
  memory = {f: int(getattr(stats, f, 0) or 0) for f in MEMORY_FIELDS}
  memory['peak_estimate_bytes'] = (memory['argument_size_in_bytes'] +
                                   memory['output_size_in_bytes'] +
                                   memory['temp_size_in_bytes'] - memory['alias_size_in_bytes'])
  return memory


def build(request: dict):
  """(config, corpus, variants [(mode, setup, compiled, state)], what `ready` reports)."""
  config = config_lib.default_config()
  overlay(config, json.loads(request['config']))
  corpus, variants, report = None, [], []
  for index, mesh in enumerate(request['meshes']):
    if mesh:
      config_lib.set_mesh_shape(config, mesh, '--meshes')
    run = assemble(config, corpus=corpus)  # Reads the data once, as the parent's bench does.
    corpus, setup = run.corpus, run.setup
    abstract = setup.abstract_batch(config.data.global_batch_size, config.data.seq_len)
    for mode in request['modes']:
      steps = parallel.STEP_BUILDERS[mode](setup)
      start = time.perf_counter()
      compiled = compile_train_step(steps, setup, abstract)
      seconds = time.perf_counter() - start
      variants.append((mode, setup, compiled, setup.init(config.seed)[0]))
      report.append({'mode': mode, 'mesh_index': index, 'compile_s': seconds,
                     'memory': memory_of(compiled), 'hlo': compiled.as_text()})
  return config, corpus, variants, report


def serve(protocol, config, corpus, variants) -> None:
  """One step of every variant per `step` line, on the next batch, until `quit`."""
  size, processes = config.data.global_batch_size, jax.process_count()
  batches = data.batches(corpus, config.data, 'train', size, config.seed, jax.process_index(),
                         processes)
  states = [state for *_, state in variants]
  for i, line in enumerate(sys.stdin):
    if line.strip() == 'quit':
      return
    if line.strip() != 'step':
      raise ValueError(f'baseline: unknown command {line.strip()!r} (expected: step | quit)')
    host_batch, step_ms, losses = batches[i], [0.0] * len(variants), [0.0] * len(variants)
    order = list(range(len(variants)))
    for k in order[i % len(order):] + order[:i % len(order)]:  # Rotating, as the parent does.
      _, setup, compiled, _ = variants[k]
      batch = data.to_global(host_batch[:size // processes], setup.batch_sharding(), size)
      start = time.perf_counter()
      states[k], metrics = compiled(states[k], batch)
      jax.block_until_ready((states[k], metrics))
      step_ms[k] = 1e3 * (time.perf_counter() - start)
      losses[k] = float(metrics['loss'])
    protocol.write(json.dumps({'step_ms': step_ms, 'loss': losses}) + '\n')
    protocol.flush()


def main() -> None:
  # stdout is the protocol's alone: whatever else writes to file descriptor 1 goes to stderr.
  protocol = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  config, corpus, variants, report = build(json.loads(sys.stdin.readline()))
  protocol.write('ready ' + json.dumps({'variants': report}) + '\n')
  protocol.flush()
  serve(protocol, config, corpus, variants)


if __name__ == '__main__':
  main()
