"""Step time, FLOP/s, memory and collectives of training-step variants, measured in one run.

A variant is a mode on a mesh. Every variant is compiled first, then their steps run interleaved
in rounds (one step of each, the order rotating from round to round) on the same batches
from the same initial parameters, so that machine noise and drift hit all alike.
`python -m engine.bench` is the command line; `engine.analysis.compare` reuses the interleaved
run for its report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import NoReturn

import jax
import numpy as np
from absl import logging

from engine import data, parallel
from engine.train import goodput, profiling
from engine.assemble import compile_train_step
from engine import chips
from engine.analysis import collectives, verdicts
from engine.analysis import references
from engine.config import MESH_AXES, with_values
from engine.errors import ConfigError
from engine.runtime.progress import Progress, phase
from engine.train.metrics import log_memory
from engine.state import TrainSetup


@dataclasses.dataclass
class ModeRun:
  """One variant's compiled step and what was measured of it."""
  mode: str
  setup: TrainSetup
  compiled: object
  compile_seconds: float
  memory: dict[str, int]
  collectives: list[collectives.Collective]
  step_seconds: list[float] = dataclasses.field(default_factory=list)
  losses: list[float] = dataclasses.field(default_factory=list)
  grad_norms: list[float] = dataclasses.field(default_factory=list)
  first_step_s: float | None = None  # Its first step's end, in seconds after the process start.

  @property
  def mesh(self) -> str:
    return mesh_name(dict(self.setup.mesh.shape))

  def median_ms(self) -> float:
    return 1e3 * float(np.median(self.step_seconds))


def check_timing_flags(steps: int, warmup: int) -> None:
  """--steps (timed) and --warmup (untimed) of the commands that time steps."""
  if steps < 1 or warmup < 0:
    raise ConfigError(f'--steps={steps} must be >= 1 and --warmup={warmup} >= 0.')


def mesh_name(shape: dict[str, int]) -> str:
  """'data 2 x tensor 4' (axes of size 1 left out; a single device is 'one device')."""
  parts = [f'{axis} {shape[axis]}' for axis in MESH_AXES if shape.get(axis, 1) > 1]
  return ' x '.join(parts) or 'one device'


def compile_mode(train_setup: TrainSetup, mode: str, abstract_batch,
                 place: str = 'the variant') -> ModeRun:
  """`place` names the variant in the progress lines ('variant 2 of 4')."""
  steps = parallel.build_steps(mode, train_setup)
  mesh = mesh_name(dict(train_setup.mesh.shape))
  with phase(f'the train step, {mode} on {mesh} ({place})') as timer:
    compiled = compile_train_step(steps, train_setup, abstract_batch)
  return ModeRun(mode, train_setup, compiled, timer.seconds,
                 log_memory(f'{mode} {mesh} train step', compiled),
                 collectives.count_collectives(compiled.as_text(), train_setup.mesh))


def run_variants(config, corpus: data.Corpus, variants: list[tuple[str, TrainSetup]],
                 num_steps: int, warmup: int = 2, observe: Callable | None = None,
                 each_round: Callable[[bool], None] | None = None,
                 batch_sizes: list[int] | None = None, profile: str | None = None,
                 before_rounds: Callable[[], None] | None = None) -> list[ModeRun]:
  """Compiles every (mode, setup), then runs their steps interleaved on the same batches.

  `observe(step, run, state, host_batch)` is called after each variant's step, outside the timed
  region (step counts from 1, warm-up included). `each_round(timed)` takes a turn in every
  round like one more variant (an external reference's step, for instance). `batch_sizes`
  (default: the config's for all) gives each variant its global batch: the first rows of each
  host's share of the largest. `profile` (a directory): after the timed rounds, each variant's
  trace of PROFILE_STEPS more steps into profile/<variant_directory>. `before_rounds()` runs
  once between the compiles and the first round (a calibration, for instance).
  """
  seq_len = config.data.seq_len
  batch_sizes = batch_sizes or [config.data.global_batch_size] * len(variants)
  runs = [compile_mode(s, mode, s.abstract_batch(size, seq_len),
                       f'variant {i} of {len(variants)}')
          for i, ((mode, s), size) in enumerate(zip(variants, batch_sizes), 1)]
  states = [run.setup.init(config.seed)[0] for run in runs]
  processes = jax.process_count()
  batches = data.batches(corpus, config.data, 'train', max(batch_sizes), config.seed,
                         jax.process_index(), processes)
  if before_rounds:
    before_rounds()
  progress = Progress(warmup + num_steps, f'Interleaved steps ({warmup} warm-up)', 'round')
  for i in range(warmup + num_steps):
    # Whoever runs first in a round finds the caches cold after the others; rotating the order
    # every round spreads that over all of them.
    turns = list(range(len(runs))) + ([None] if each_round else [])
    shift = i % len(turns)
    host_batch = batches[i]  # Read once per round; grain computes an element on each access.
    for k in turns[shift:] + turns[:shift]:
      if k is None:
        each_round(i >= warmup)
        continue
      run = runs[k]
      batch = data.to_global(host_batch[:batch_sizes[k] // processes],
                             run.setup.batch_sharding(), batch_sizes[k])
      start = time.perf_counter()
      states[k], metrics = run.compiled(states[k], batch)
      jax.block_until_ready((states[k], metrics))
      if run.first_step_s is None:
        run.first_step_s = time.time() - goodput.process_started()
      if i >= warmup:
        run.step_seconds.append(time.perf_counter() - start)
      run.losses.append(float(metrics['loss']))
      run.grad_norms.append(float(metrics['grad_norm']))
      if observe:
        observe(i + 1, run, states[k], host_batch)
    progress.update()
  progress.finish()
  if profile:
    _profile_variants(runs, states, batch_sizes, [batches[warmup + i] for i in range(
        min(PROFILE_STEPS, num_steps))], profile)
  return runs


# Steps per variant in a --profile trace: a few are enough to see one step's ops and gaps.
PROFILE_STEPS = 3


def variant_directory(run: ModeRun) -> str:
  """'data8_tensor4-manual': the variant's mesh and mode, as a directory name."""
  return f"{run.mesh.replace(' x ', '_').replace(' ', '')}-{run.mode}"


def _profile_variants(runs: list[ModeRun], states: list, batch_sizes: list[int],
                      host_batches: list, directory: str) -> None:
  """Each variant's steps on the timed rounds' first batches, traced apart from the timing (the
  profiler's own cost stays out of the step times), one variant at a time."""
  processes = jax.process_count()
  for run, state, size in zip(runs, states, batch_sizes):
    batches = [data.to_global(b[:size // processes], run.setup.batch_sharding(), size)
               for b in host_batches]
    path = profiling.trace_directory(os.path.join(directory, variant_directory(run)))
    profiling.trace_steps(path, run.compiled, state, batches)
  logging.info('Profiled %d steps of each variant into %s/<mesh>-<mode>; open it with '
               '`tensorboard --logdir=%s` (pip install tensorboard tensorboard-plugin-profile; '
               'the Profile tab).', len(host_batches), directory, directory)


def run_interleaved(config, corpus: data.Corpus, train_setup: TrainSetup, modes: list[str],
                    num_steps: int, warmup: int = 2,
                    observe: Callable | None = None) -> list[ModeRun]:
  """`run_variants` for several modes on one setup (engine.assemble)."""
  return run_variants(config, corpus, [(mode, train_setup) for mode in modes], num_steps,
                      warmup, observe)


def fit_bubble(microbatches: list[int], seconds: list[float]) -> tuple[float, list[float]]:
  """(seconds per micro-batch, measured bubble at each count) from the least-squares line
  t = slope x M + intercept through the step times."""
  slope, _ = np.polyfit(np.asarray(microbatches, float), np.asarray(seconds, float), 1)
  return float(slope), [1 - slope * m / t for m, t in zip(microbatches, seconds)]


def measurements(run: ModeRun, tokens_per_step: int, model_flops_per_step: float,
                 peak_flops_per_device: float | None,
                 causal_flops_per_step: float | None = None) -> dict:
  """One variant's row: speed, model FLOP/s and MFU, per-device memory, collectives.
  `causal_flops_per_step`: the same FLOPs with causal attention's halved (the convention of
  MaxText and Megatron), for a second MFU column."""
  seconds = np.array(run.step_seconds)
  median = float(np.median(seconds))
  num_devices = run.setup.mesh.devices.size
  achieved = model_flops_per_step / median / num_devices
  causal = (causal_flops_per_step / median / num_devices / peak_flops_per_device
            if causal_flops_per_step and peak_flops_per_device else None)
  return {
      'mode': run.mode, 'mesh': run.mesh, 'mesh_shape': dict(run.setup.mesh.shape),
      'compile_s': run.compile_seconds,
      'median_ms': 1e3 * median, 'min_ms': 1e3 * float(seconds.min()),
      'max_ms': 1e3 * float(seconds.max()), 'step_ms': (1e3 * seconds).tolist(),
      'tokens_per_s': tokens_per_step / median,
      'model_tflop_per_step': model_flops_per_step / 1e12,
      'model_tflops_per_device': achieved / 1e12,
      'mfu': achieved / peak_flops_per_device if peak_flops_per_device else None,
      'mfu_causal': causal, 'first_step_s': run.first_step_s,
      'memory': run.memory, 'losses': run.losses,
      'collectives': [{'kind': kind, 'axes': list(axes), **row}
                      for (kind, axes), row in collectives.summarize(run.collectives).items()],
  }


def _collectives_cell(rows: list[dict]) -> str:
  """One line per (kind, axes), with the element types it moved; '>= ' where a loop's unknown
  trip count makes it a lower bound (engine.analysis.collectives)."""
  bound = lambda r: '>= ' if r.get('ops_in_unknown_loops') else ''
  types = lambda r: f' ({t})' if (t := verdicts.element_types(r)) != '-' else ''
  return '<br>'.join(f'{r["kind"]} {",".join(r["axes"]) or "-"}: {bound(r)}{r["executions"]}x, '
                     f'{bound(r)}{r["bytes"] / 2**20:.1f} MiB{types(r)}' for r in rows) or 'none'


def markdown(rows: list[dict], title: str, external: dict | None = None) -> str:
  """The table: one line per variant; `vs first` is the ratio of median step times to the first
  mode on the same mesh, `of matmul` the model FLOP/s per device over the calibrated matmul's
  (row['of_matmul'], engine.bench.calibration; n/a without)."""
  label = lambda r: r['mesh'] + (' (dense equivalent)' if r.get('dense_equivalent') else '')
  first = {}
  for row in rows:
    first.setdefault(label(row), row['median_ms'])
  lines = [f'## {title}', '',
           '| mesh | mode | median ms | min | max | vs first | tokens/s | compile s | '
           'first step s | model TFLOP/s/device | MFU | MFU, causal halved | of matmul | '
           'args MiB | temp MiB | peak MiB | collectives per step |',
           '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|']
  percent = lambda x: f'{100 * x:.1f} %' if x is not None else 'n/a'
  for r in rows:
    m = r['memory']
    mfu, causal = percent(r['mfu']), percent(r.get('mfu_causal'))
    first_step = f'{r["first_step_s"]:.1f}' if r.get('first_step_s') is not None else 'n/a'
    of_matmul = percent(r.get('of_matmul'))
    lines.append(
        f'| {label(r)} | {r["mode"]} | {r["median_ms"]:.1f} | {r["min_ms"]:.1f} | '
        f'{r["max_ms"]:.1f} | {r["median_ms"] / first[label(r)]:.3f} | '
        f'{r["tokens_per_s"]:,.0f} | {r["compile_s"]:.1f} | {first_step} | '
        f'{r["model_tflops_per_device"]:.4f} | {mfu} | {causal} | {of_matmul} | '
        f'{m.get("argument_size_in_bytes", 0) / 2**20:.1f} | '
        f'{m.get("temp_size_in_bytes", 0) / 2**20:.1f} | '
        f'{m.get("peak_estimate_bytes", 0) / 2**20:.1f} | {_collectives_cell(r["collectives"])} |')
  if any(c.get('ops_in_unknown_loops') for r in rows for c in r['collectives']):
    lines += ['', 'Collectives marked >= sit in a `while` loop whose trip count is unknown '
              '(neither recorded in the HLO nor readable off the loop): its body is counted '
              'once, so their counts and bytes are lower bounds.']
  if external:
    lines += ['', f'{external["name"]}, interleaved with the rows above: median '
              f'{external["median_ms"]:.1f} ms (min {external["min_ms"]:.1f}, max '
              f'{external["max_ms"]:.1f}); the first row / it = '
              f'{rows[0]["median_ms"] / external["median_ms"]:.2f}.']
  return '\n'.join(lines)


def dense_equivalent(config):
  """The dense Llama with a mixture of experts' active parameters per token (each MLP as wide as
  the k routed experts and the shared one together), on the same mesh with the expert axis
  folded into data (which then splits the batch as the expert axis did)."""
  if not config.model.get('num_experts', 0):
    raise ConfigError('--dense_equivalent: the config is not a mixture of experts '
                      '(model.num_experts=0); set model.num_experts, or drop the flag.')
  m, mesh = config.model, config.mesh
  return with_values(config, {
      'model.mlp_dim': m.experts_per_token * (m.moe_mlp_dim or m.mlp_dim) + m.moe_shared_expert,
      'model.num_experts': 0,
      # -1: the devices the other axes leave, expert's among them.
      'mesh.data': -1 if -1 in (mesh.data, mesh.expert) else mesh.data * mesh.expert,
      'mesh.expert': 1})


def dense_comparison(rows: list[dict]) -> str:
  """Each mixture-of-experts variant's tokens/s beside its dense equivalent's: the same mode on
  the mesh with the expert axis folded into data (rows marked `dense_equivalent`)."""
  dense = {(r['mesh'], r['mode']): r for r in rows if r.get('dense_equivalent')}
  lines = ['| mesh | mode | MoE tokens/s | dense equivalent on | dense tokens/s | MoE / dense |',
           '|---|---|---:|---|---:|---:|']
  for r in rows:
    if r.get('dense_equivalent'):
      continue
    shape = dict(r['mesh_shape'])
    shape['data'] = shape.get('data', 1) * shape.pop('expert', 1)
    if d := dense.get((mesh_name(shape), r['mode'])):
      lines.append(f'| {r["mesh"]} | {r["mode"]} | {r["tokens_per_s"]:,.0f} | {d["mesh"]} | '
                   f'{d["tokens_per_s"]:,.0f} | {r["tokens_per_s"] / d["tokens_per_s"]:.2f} |')
  return '\n'.join(lines)


def peak_flops_per_device(dtype: str, override_tflops: float | None) -> float | None:
  return chips.peak_flops(jax.devices()[0].device_kind, dtype, override_tflops)


def check_torch_python(python: str) -> None:
  """`python` must run and import torch: checked before anything compiles, so a wrong
  --torch_python is one line, not a failed child after minutes of compiling."""
  try:
    result = subprocess.run([python, '-c', 'import torch'], capture_output=True, text=True,
                            timeout=300)
  except OSError as error:
    raise ConfigError(f'--torch_python={python} cannot be run ({error.strerror}); give the path '
                      'of a Python that has torch, e.g. --torch_python=/opt/torch-venv/bin/python.'
                      ) from None
  if result.returncode != 0:
    why = (result.stderr.strip().splitlines() or ['no output'])[-1]
    raise ConfigError(f'--torch_python={python} cannot import torch ({why}); install it into '
                      f'that Python ({python} -m pip install torch), or point --torch_python at '
                      'a Python that has it.')


def stderr_tail(file, lines: int = 10) -> str:
  file.seek(0)
  text = file.read().decode(errors='replace').strip().splitlines()[-lines:]
  return '\n'.join(text) or '(nothing on stderr)'


def child_failed(process: subprocess.Popen, stderr, what: str, command: str) -> NoReturn:
  """Raises `what` with the child's status, its command and the end of its stderr (a file),
  once it has exited (killed if it does not within 10 s)."""
  try:
    process.wait(timeout=10)
  except subprocess.TimeoutExpired:
    process.kill()
  raise RuntimeError(f'{what} (status {process.poll()}): {command}\nIts stderr ends:\n'
                     f'{stderr_tail(stderr)}')


class TorchReference:
  """The PyTorch version of the GPT model (engine/analysis/references/torch_reference.py) in a child
  process run by a Python that has torch; one of its steps runs after each round of ours."""

  def __init__(self, python: str, model_config, vocab_size: int, seq_len: int,
               global_batch: int, threads: int):
    script = references.script('torch_reference.py')
    args = [python, script, '--layers', str(model_config.num_layers),
            '--heads', str(model_config.num_heads), '--width', str(model_config.embed_dim),
            '--mlp', str(model_config.mlp_dim), '--vocab', str(vocab_size),
            '--seq', str(seq_len), '--batch', str(global_batch), '--threads', str(threads)]
    if not model_config.tie_embeddings:
      args.append('--no-tie')
    self.command = ' '.join(args)
    # Its stderr goes to a file (a pipe nobody reads could fill and stall it), shown on failure.
    self.stderr = tempfile.TemporaryFile()
    self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=self.stderr, text=True)
    if self.process.stdout.readline().strip() != 'ready':
      self._failed('did not start')
    self.step_ms: list[float] = []

  def _failed(self, what: str) -> NoReturn:
    child_failed(self.process, self.stderr, f'the PyTorch reference {what}', self.command)

  def __call__(self, timed: bool) -> None:
    try:
      self.process.stdin.write('step 1\n')
      self.process.stdin.flush()
    except BrokenPipeError:
      self._failed('stopped')
    line = self.process.stdout.readline()
    if not line:
      self._failed('stopped')
    reply = json.loads(line)
    if timed:
      self.step_ms += reply['step_ms']

  def close(self) -> dict:
    self.process.stdin.write('quit\n')
    self.process.stdin.flush()
    self.process.wait(timeout=60)
    self.stderr.close()
    t = np.array(self.step_ms)
    return {'name': 'PyTorch, same model and shapes', 'median_ms': float(np.median(t)),
            'min_ms': float(t.min()), 'max_ms': float(t.max()), 'step_ms': t.tolist()}
