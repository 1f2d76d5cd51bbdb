"""Auto against manual on the same model, data, seed and mesh, measured: the library of
`python -m engine.analysis.compare` (engine/analysis/compare/__main__.py, the command).

`compare` starts every mode from the same sharded initial state on the same batches, their steps
interleaved (engine.analysis.benchmark); `NumericsObserver` compares each mode's parameters, loss
and gradient norm after every step with the single-device reference (engine.analysis.reference);
engine.analysis.verdicts' `communication_table` sets the bytes each mode's collectives move
beside the theory (engine.analysis.comm_theory). The report goes to engine.analysis.compare.report.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from absl import logging

from engine import parallel
from engine.workdir import run_dir as workdir_lib
from engine.analysis import benchmark, collectives, comm_theory, verdicts
from engine.analysis.compare import report as compare_report
from engine.analysis.reference import ReferenceRun
from engine.assemble import assemble
from engine.parallel.pipeline.gpipe import schedule_of
from engine.runtime.progress import phase


def flat_params(params) -> dict[str, np.ndarray]:
  """'blocks/w_up_DF' -> host array, for every parameter."""
  return {'/'.join(str(k.key) for k in path): np.asarray(value)
          for path, value in jax.tree_util.tree_leaves_with_path(jax.device_get(params))}


@dataclasses.dataclass
class Divergence:
  step: int
  parameter: str  # Or 'loss'.
  abs_diff: float


@dataclasses.dataclass
class ModeNumerics:
  """How far one mode is from the reference: per step, and per parameter after the last step."""
  max_abs_diff_per_step: list[float] = dataclasses.field(default_factory=list)
  final_abs: dict[str, float] = dataclasses.field(default_factory=dict)
  final_rel: dict[str, float] = dataclasses.field(default_factory=dict)
  first_divergence: Divergence | None = None


class NumericsObserver:
  """Steps the reference on each batch and measures every mode's parameters against it.

  Relative difference of a parameter = max |mode - reference| / max |reference|, i.e. relative
  to the parameter's scale (elementwise ratios blow up at entries near zero)."""

  def __init__(self, reference: ReferenceRun, atol: float):
    self.reference = reference
    self.atol = atol
    self.reference_losses: list[float] = []
    self.reference_grad_norms: list[float] = []
    self.modes: dict[str, ModeNumerics] = {}
    self._reference_params: dict[str, np.ndarray] = {}

  def __call__(self, step: int, run: benchmark.ModeRun, state, host_batch) -> None:
    if len(self.reference_losses) < step:
      metrics = self.reference.step(host_batch)
      self.reference_losses.append(metrics['loss'])
      self.reference_grad_norms.append(metrics['grad_norm'])
      self._reference_params = flat_params(self.reference.params)
    numerics = self.modes.setdefault(run.mode, ModeNumerics())
    params = flat_params(state['params'])
    worst = 0.0
    for path, ref in self._reference_params.items():
      diff = float(np.abs(params[path] - ref).max())
      worst = max(worst, diff)
      numerics.final_abs[path] = diff
      numerics.final_rel[path] = diff / max(float(np.abs(ref).max()), 1e-30)
      if diff > self.atol and numerics.first_divergence is None:
        numerics.first_divergence = Divergence(step, path, diff)
    # Adam's update hardly depends on the gradient's scale, so a wrongly scaled gradient (summed
    # instead of averaged) barely shows in the parameters: the gradient norm catches it.
    for name, mine, ref in (('loss', run.losses, self.reference_losses),
                            ('gradient norm', run.grad_norms, self.reference_grad_norms)):
      diff = abs(mine[step - 1] - ref[step - 1])
      if diff > self.atol * max(1.0, abs(ref[step - 1])) and numerics.first_divergence is None:
        numerics.first_divergence = Divergence(step, name, diff)
    numerics.max_abs_diff_per_step.append(worst)


def verdict(numerics: dict[str, ModeNumerics], atol: float, steps: int) -> str:
  lines = []
  for mode, n in numerics.items():
    if n.first_divergence is None:
      worst = max(n.max_abs_diff_per_step)
      lines.append(f'{mode}: AGREES with the single-device reference within atol={atol:g} on the '
                   f'loss, the gradient norm and every parameter after each of {steps} steps '
                   f'(largest parameter difference {worst:.2e}).')
    else:
      d = n.first_divergence
      lines.append(f'{mode}: DIVERGES from the single-device reference: {d.parameter} first '
                   f'exceeds atol={atol:g} at step {d.step} (max abs difference {d.abs_diff:.2e}).')
  return '\n'.join(lines)


def compare(config, workdir: str, modes: list[str], steps: int, warmup: int = 2,
            atol: float = 1e-4) -> dict:
  """Runs the comparison and writes the report; returns the report's data."""
  parallel.check_modes(modes, '--modes')
  run = assemble(config)
  config, corpus, train_setup = run.config, run.corpus, run.setup  # The config as it ran.
  workdir_lib.prepare(workdir)  # A directory this process can write, before anything runs.
  observer = None
  if jax.process_count() == 1:
    with phase('the single-device reference', 'Initialising', 'Initialised'):
      reference = ReferenceRun(train_setup.model, config.optim, config.train.num_steps,
                               config.seed)  # Its step compiles in the first round.
    observer = NumericsObserver(reference, atol)
  else:
    logging.warning('Several processes: the single-device reference is skipped.')
  runs = benchmark.run_interleaved(config, corpus, train_setup, modes, steps, warmup, observer)
  tokens = config.data.global_batch_size * config.data.seq_len
  theory = comm_theory.expected_bytes(train_setup, config.data.global_batch_size,
                                      config.data.seq_len)
  report = {
      'mesh': dict(train_setup.mesh.shape), 'modes': modes, 'steps': warmup + steps,
      'timed_steps': steps, 'warmup': warmup, 'atol': atol, 'tokens_per_step': tokens,
      'microbatches': config.train.microbatches,
      'pipeline_repeats': config.train.pipeline_repeats,
      'pipeline_schedule': schedule_of(config.train), 'dtype': config.model.dtype,
      'losses': {run.mode: run.losses for run in runs},
      'speed': {run.mode: {
          'compile_s': run.compile_seconds, 'median_ms': run.median_ms(),
          'min_ms': 1e3 * min(run.step_seconds), 'max_ms': 1e3 * max(run.step_seconds),
          'tokens_per_s': tokens / (run.median_ms() / 1e3),
          'step_ms': [1e3 * s for s in run.step_seconds]} for run in runs},
      'memory': {run.mode: run.memory for run in runs},
      'attention_heads': train_setup.attention_heads(),
      'communication': verdicts.communication_table(runs, theory),
  }
  flags = verdicts.off_theory(report['communication'], modes,
                              verdicts.context_for(train_setup, config))
  verdicts.log(flags)
  report['off_theory'] = [dataclasses.asdict(f) for f in flags]
  if len(runs) == 2:
    report['speed']['ratio'] = {'of': f'{runs[1].mode}/{runs[0].mode}',
                                'median': runs[1].median_ms() / runs[0].median_ms()}
  if observer:
    report['reference_losses'] = observer.reference_losses
    report['reference_grad_norms'] = observer.reference_grad_norms
    report['grad_norms'] = {run.mode: run.grad_norms for run in runs}
    report['numerics'] = {mode: dataclasses.asdict(n) for mode, n in observer.modes.items()}
    report['verdict'] = verdict(observer.modes, atol, warmup + steps)
  compare_report.write(workdir, report)
  return report
