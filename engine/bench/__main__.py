"""Speed of training-step variants (modes x meshes), measured side by side in one process.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.bench \
      --config=experiments/llama_bench.py --modes=auto,manual \
      --meshes=8x1x1,1x8x1,2x1x4,1x2x4,2x2x2 --steps=20 --out=/tmp/bench

Every variant is compiled once, then the variants' steps run interleaved on the same batches
from the same initial parameters, the order rotating every round (engine.analysis.benchmark).
Printed, and written as Markdown (OUT.md) and JSON (OUT.json): compile time, when the
variant's first step ended (seconds after the process started: imports, data, every variant's
compile), median / min / max step time, tokens/s, the model's FLOPs per step (6N plus
attention, from the model spec, attention counted whole) as TFLOP/s per device and as MFU
against the chip's peak (engine.chips: known TPUs and GPUs; --peak_tflops elsewhere), MFU again
with causal attention's FLOPs halved (MaxText's and Megatron's convention), per-device memory
of the compiled step (arguments, temporaries, and `peak`: arguments + outputs + temporaries -
aliased, what MaxText prints as its total), the device allocator's peak in use where the
platform counts one, and the collectives of each compiled step by kind and mesh axes.

--profile=DIR also traces a few steps of each variant with jax.profiler, after the timed
rounds (so the profiler's cost stays out of the times), into DIR/<mesh>-<mode>, e.g.
DIR/data8-manual: `tensorboard --logdir=DIR` with tensorboard-plugin-profile shows each as a run.
The report then adds each variant's self time per step by op, split into compute, collectives
and waiting (engine/bench/op_profile.py), so where a variant's time goes needs no viewer.

--torch_python=PYTHON (a Python that has torch) also runs the PyTorch version of the GPT model
(engine/analysis/references/torch_reference.py) in a child process that takes a turn in every round;
that Python is tried (`import torch`) before anything compiles.

After the compiles, a calibration (engine.bench.calibration; --nocalibrate skips it):
the FLOP/s per device a plain matmul reaches in the model's dtype on all devices at once, in the
title, with each variant's model FLOP/s per device over it in the column `of matmul`.

--baseline=DIR (the root of another checkout, e.g. `git worktree add --detach /tmp/before HEAD`
made before a change) also builds the same variants with DIR's engine in a child process
(engine.bench.baseline) that takes a turn in every round: rows `MODE (baseline)`, and a
table of this tree / baseline median step times and the largest loss difference per variant.

--dense_equivalent (a mixture of experts) also times the dense Llama with the same active
parameters per token (mlp_dim = experts_per_token x moe_mlp_dim + moe_shared_expert) on each
mesh with the expert axis folded into data, interleaved with the rest, and prints the two
models' tokens/s side by side.
The command lives here, not in engine/analysis/, for its short name; it is an analysis tool.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from absl import flags, logging
from ml_collections import config_flags

from engine import config as config_lib
from engine import parallel
from engine.train import profiling
from engine.analysis import benchmark, comm_theory, verdicts
from engine.bench import baseline, calibration, op_profile
from engine.assemble import assemble
from engine.cli.command_line import check_out_prefix, run_command
from engine.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=False)
_MODES = flags.DEFINE_list('modes', ['auto', 'manual'], 'Modes to run, in order.')
_MESHES = flags.DEFINE_list('meshes', [], 'Meshes DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]] '
                            '(e.g. 8x1x1,2x2x2,1x1x1x8); default: the config\'s own.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps per variant.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed first steps per variant.')
_PEAK = flags.DEFINE_float('peak_tflops', None, 'Peak TFLOP/s of one device for the MFU column '
                           '(default: the chip table; none on CPUs).')
_OUT = flags.DEFINE_string('out', None, 'Write OUT.md and OUT.json.')
_PROFILE = flags.DEFINE_string('profile', None, 'Also trace a few steps of each variant, after '
                               'the timed ones, into PROFILE/<mesh>-<mode> (TensorBoard\'s '
                               'profile plugin reads PROFILE).')
_DENSE = flags.DEFINE_bool('dense_equivalent', False, 'Mixture of experts: also time, on each '
                           'mesh with the expert axis folded into data, the dense model with the '
                           'same active parameters (mlp_dim = experts_per_token x moe_mlp_dim + '
                           'moe_shared_expert).')
_TORCH = flags.DEFINE_string('torch_python', None, 'A Python with torch: also time the PyTorch '
                             'GPT (GPT configs on one device).')
_CALIBRATE = flags.DEFINE_bool('calibrate', True, 'Measure the FLOP/s per device of a plain '
                               'matmul on all devices at once, after the compiles, for the '
                               '"of matmul" column.')
_BASELINE = flags.DEFINE_string('baseline', None, 'The root of another checkout of the engine '
                                '(e.g. git worktree add --detach /tmp/before HEAD): also time its '
                                'variants on the same meshes and modes, interleaved with ours.')


def variants(config) -> tuple:
  """(the config as the last mesh's run uses it, corpus, [(mode, setup)] for every mesh and
  mode, then with --dense_equivalent those of the dense equivalent on every distinct folded
  mesh): all validated and laid out before anything compiles; `config` itself is left as
  given."""
  parallel.check_modes(_MODES.value, '--modes')
  benchmark.check_timing_flags(_STEPS.value, _WARMUP.value)
  for mesh in _MESHES.value:
    config_lib.parse_mesh(mesh, '--meshes')  # Every mesh string checked before any data is read.
  if _DENSE.value:
    benchmark.dense_equivalent(config)  # Refused before anything is laid out.
  corpus, setups, dense_meshes, used = None, [], [], config
  for mesh in _MESHES.value or ['']:
    meshed = config_lib.with_values(config, config_lib.mesh_values(mesh, '--meshes')
                                    if mesh else {})
    candidates = [meshed]
    dense = benchmark.dense_equivalent(meshed) if _DENSE.value else None
    if dense and dense.mesh.to_dict() not in dense_meshes:  # Two meshes may fold to one.
      dense_meshes.append(dense.mesh.to_dict())
      candidates.append(dense)
    for candidate in candidates:
      run = assemble(candidate, corpus=corpus)  # Reads the data once.
      corpus = run.corpus
      setups.append(run.setup)
      used = run.config if candidate is meshed else used
  setups.sort(key=lambda s: s.model.experts is None)  # The dense ones last.
  return used, corpus, [(mode, s) for s in setups for mode in _MODES.value]


def check_flags(config) -> None:
  """The flags' own values, before anything is read or compiled."""
  check_out_prefix(_OUT.value)
  if _PROFILE.value is not None and (not _PROFILE.value or os.path.isfile(_PROFILE.value)):
    raise ConfigError(f'--profile={_PROFILE.value} is not a directory; give one (it '
                      'is created if missing), e.g. --profile=/tmp/bench_profile.')
  if _PEAK.value is not None and not _PEAK.value > 0:
    raise ConfigError(f'--peak_tflops={_PEAK.value:g} must be a positive number '
                      '(one device\'s peak, TFLOP/s).')
  if _BASELINE.value is not None:
    baseline.check_baseline(_BASELINE.value)
  if _TORCH.value:
    benchmark.check_torch_python(_TORCH.value)  # First: the flag's own value.
    if config.model.name != 'gpt' or jax.device_count() != 1:
      raise ConfigError('--torch_python: the PyTorch reference is the GPT model on '
                        'one device.')


def main(argv):
  del argv
  config = _CONFIG.value
  check_flags(config)
  config_json = config.to_json()  # As given, for the baseline's own meshes and model settings.
  config, corpus, runs_to_make = variants(config)
  first_setup = runs_to_make[0][1]
  tokens = config.data.global_batch_size * config.data.seq_len
  torch = before = None
  if _TORCH.value:
    torch = benchmark.TorchReference(_TORCH.value, config.model, first_setup.model.vocab_size,
                                     config.data.seq_len, config.data.global_batch_size,
                                     os.cpu_count())
  if _BASELINE.value:  # Compiles its variants before ours do, so that the two never overlap.
    before = baseline.BaselineReference(_BASELINE.value, config_json, _MESHES.value or [''],
                                        _MODES.value)
  turns = [t for t in (torch, before) if t]
  calibrated = []
  runs = benchmark.run_variants(
      config, corpus, runs_to_make, _STEPS.value, _WARMUP.value,
      each_round=(lambda timed: [t(timed) for t in turns]) if turns else None,
      profile=_PROFILE.value, before_rounds=lambda: calibrated.append(
          calibration.matmul_flops_per_device(config.model.dtype) if _CALIBRATE.value else None))
  external = torch.close() if torch else None
  if before:  # This tree's setup of each mesh (variants() makes one per mesh, modes inner).
    runs += before.close([s for _, s in runs_to_make[::len(_MODES.value)]])
  report(config, runs, tokens, calibrated[0], external)


def report(config, runs: list, tokens: int, matmul: float | None, external: dict | None) -> None:
  """Prints the tables; with --out, writes them to OUT.md and everything to OUT.json."""
  peak = benchmark.peak_flops_per_device(config.model.dtype, _PEAK.value)
  seq_len = config.data.seq_len  # Each variant's own model FLOPs (a dense equivalent's differ).
  rows = []
  for run in runs:
    flops = run.setup.model.flops_per_token
    # Attention's FLOPs grow with the sequence, the weights' do not: halving the difference
    # counts a causal mask's skipped half (MaxText's and Megatron's convention).
    causal = (flops(seq_len) + flops(0)) / 2
    row = benchmark.measurements(run, tokens, flops(seq_len) * tokens, peak, causal * tokens)
    row['dense_equivalent'] = _DENSE.value and run.setup.model.experts is None
    row['baseline'] = run.mode.endswith(baseline.SUFFIX)
    row['of_matmul'] = row['model_tflops_per_device'] * 1e12 / matmul if matmul else None
    rows.append(row)
  rows = baseline.interleave([r for r in rows if not r['baseline']],
                             [r for r in rows if r['baseline']])
  title = (f'{config.model.name}, {config.model.num_layers} layers, width '
           f'{config.model.embed_dim}, sequence {config.data.seq_len}, batch '
           f'{config.data.global_batch_size}, {config.model.dtype}, remat {config.model.remat}; '
           f'{jax.device_count()} x {jax.devices()[0].device_kind}; {_STEPS.value} timed steps')
  if config.model.matmul_precision != 'default':
    title += f'; {config.model.matmul_precision} projections'
  if matmul:
    title += f'; calibrated matmul: {matmul / 1e12:.4g} TFLOP/s per device'
  in_use = device_peak_bytes()
  if in_use:
    title += f'; device peak in use (all variants): {in_use / 2**30:.2f} GiB'
  off = off_theory(config, [r for r in runs if not r.mode.endswith(baseline.SUFFIX)])
  text = '\n'.join(verdicts.markdown(off)) + '\n' + benchmark.markdown(rows, title, external)
  if config.model.matmul_precision != 'default' and jax.devices()[0].platform == 'cpu':
    text += ('\n\nXLA:CPU has no int8 or fp8 matrix units: it runs the quantized matmuls as '
             'float32 products, after the quantization\'s own work, so this step is slower than '
             'the unquantized one here. On TPU and GPU they run on the chip\'s int8 / fp8 units '
             '(engine.plan times them at those peaks).')
  if _DENSE.value:
    text += '\n\n' + benchmark.dense_comparison(rows)
  pairs = baseline.comparison(rows) if _BASELINE.value else None
  if pairs is not None:
    text += '\n\n' + baseline.comparison_markdown(pairs, _BASELINE.value)
  ops = profiled_ops(runs) if _PROFILE.value else {}
  if ops:
    text += ('\n\nSelf time per step by op, summed over the device threads, from the --profile '
             'traces (engine/bench/op_profile.py):\n\n' + op_profile.markdown(list(ops.items())))
  print(text)
  if _OUT.value:
    with open(_OUT.value + '.md', 'w') as f:
      f.write(text + '\n')
    with open(_OUT.value + '.json', 'w') as f:
      json.dump({'title': title, 'tokens_per_step': tokens,
                 'model_flops_per_step': runs[0].setup.model.flops_per_token(seq_len) * tokens,
                 'peak_flops_per_device': peak, 'matmul_flops_per_device': matmul,
                 'device_peak_bytes_in_use': in_use,
                 'config': json.loads(config.to_json()), 'variants': rows, 'external': external,
                 'baseline': pairs and {'directory': os.path.abspath(_BASELINE.value),
                                        'comparison': pairs},
                 'ops_seconds_per_step': ops,
                 'off_theory': [dataclasses.asdict(f) for f in off]}, f, indent=1)
    logging.info('Wrote %s.md and %s.json', _OUT.value, _OUT.value)


def device_peak_bytes() -> int | None:
  """The most memory any local device has held at once in this process (the allocator's
  peak_bytes_in_use; None where the platform keeps no such count, as XLA:CPU)."""
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  peaks = [s['peak_bytes_in_use'] for s in stats if 'peak_bytes_in_use' in s]
  return max(peaks) if peaks else None


def off_theory(config, runs: list) -> list:
  """Every variant's collectives off the communication theory (engine.analysis.verdicts),
  logged as they are found."""
  found = []
  for run in runs:
    theory = comm_theory.expected_bytes(run.setup, config.data.global_batch_size,
                                        config.data.seq_len)
    found += verdicts.off_theory(verdicts.communication_table([run], theory), [run.mode],
                                 verdicts.context_for(run.setup, config), run.mesh)
  verdicts.log(found)
  return found


def profiled_ops(runs: list) -> dict[str, dict[str, float]]:
  """{'<mesh> <mode>': op_profile.op_totals} of this tree's variants' --profile traces."""
  ops = {}
  for run in runs:
    if run.mode.endswith(baseline.SUFFIX):  # The baseline's steps are not traced.
      continue
    path = op_profile.trace_file(profiling.trace_directory(
        os.path.join(_PROFILE.value, benchmark.variant_directory(run))))
    if path:
      ops[f'{run.mesh} {run.mode}'] = op_profile.op_totals(
          path, min(benchmark.PROFILE_STEPS, _STEPS.value))
  return ops


if __name__ == '__main__':
  run_command(main, 'engine.bench', required=('config',))
