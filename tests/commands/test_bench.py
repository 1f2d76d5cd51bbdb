"""`python -m engine.bench` end to end on a tiny model, and the chip table behind its MFU."""

import collections
import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from engine import chips
from engine.analysis import benchmark
from engine.assemble import assemble
from engine.bench import op_profile
from engine.errors import ConfigError
from engine.runtime.progress import duration
from tests.support.helpers import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope='module')
def bench(tmp_path_factory):
  """One bench run for the tests below: two meshes, both modes, this tree as its own baseline.
  (the report, OUT.md's text, the directory of --out and --profile)."""
  tmp_path = tmp_path_factory.mktemp('bench')
  done = _bench('--meshes=8x1x1,1x2x4', '--modes=auto,manual', '--steps=2', '--warmup=1',
                '--peak_tflops=0.5', f'--out={tmp_path / "bench"}',
                f'--profile={tmp_path / "trace"}', f'--baseline={ROOT}')
  assert done.returncode == 0, done.stderr
  (tmp_path / 'stderr.txt').write_text(done.stderr)
  return (json.loads((tmp_path / 'bench.json').read_text()),
          (tmp_path / 'bench.md').read_text(), tmp_path)


def _bench(*flags, devices=8):
  """engine.bench on the tiny model, on `devices` CPU devices; its output captured."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=(
      f'--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0'))
  return subprocess.run(
      [sys.executable, '-m', 'engine.bench', '--config=experiments/tiny.py',
       '--config.model.num_layers=2', '--config.data.source=synthetic', *flags],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_bench_measures_every_mode_on_every_mesh(bench):
  report, markdown, tmp_path = bench
  rows = [r for r in report['variants'] if not r['baseline']]
  assert [(r['mesh'], r['mode']) for r in rows] == [
      ('data 8', 'auto'), ('data 8', 'manual'),
      ('fsdp 2 x tensor 4', 'auto'), ('fsdp 2 x tensor 4', 'manual')]
  config = report['config']
  assert report['tokens_per_step'] == config['data']['global_batch_size'] * config['data'][
      'seq_len']
  for r in report['variants']:
    assert len(r['step_ms']) == 2 and r['min_ms'] <= r['median_ms'] <= r['max_ms']
    per_device = report['model_flops_per_step'] / (r['median_ms'] / 1e3) / 8
    assert r['mfu'] == pytest.approx(per_device / 0.5e12)
    assert r['memory']['argument_size_in_bytes'] > 0 and r['compile_s'] > 0
    # Same initial parameters and batches: every variant computes the same losses.
    assert r['losses'] == pytest.approx(rows[0]['losses'], rel=1e-4)
  kinds = {(r['mesh'], r['mode']): {(c['kind'], tuple(c['axes'])) for c in r['collectives']}
           for r in rows}
  assert kinds[('data 8', 'manual')] == {('all-reduce', ('data',))}
  assert {('all-gather', ('fsdp',)), ('all-reduce', ('tensor',))} <= kinds[
      ('fsdp 2 x tensor 4', 'manual')]
  # Its two rows, the baseline's two and their two lines of the this tree / baseline table.
  assert markdown.count('| data 8 |') == 6 and 'MFU' in markdown
  # --profile: a trace of each variant (of this tree), in a directory of its own.
  traces = {p.relative_to(tmp_path / 'trace').parts[0]: p.stat().st_size
            for p in (tmp_path / 'trace').glob('*/plugins/profile/*/*.xplane.pb')}
  assert sorted(traces) == ['data8-auto', 'data8-manual', 'fsdp2_tensor4-auto',
                            'fsdp2_tensor4-manual'] and min(traces.values()) > 0, traces
  # ... and each trace's ops, by self time: every variant computes and communicates.
  ops = report['ops_seconds_per_step']
  assert sorted(ops) == ['data 8 auto', 'data 8 manual', 'fsdp 2 x tensor 4 auto',
                         'fsdp 2 x tensor 4 manual']
  for totals in ops.values():
    sums = op_profile.split(totals)
    assert sums['compute'] > 0 and sums['collectives'] > 0, totals
  assert 'Self time per step by op' in markdown and '| data 8 manual |' in markdown
  # The report opens with the collectives off their theory: none unexplained here.
  assert markdown.startswith('## Collectives off their theory')
  assert 'UNEXPLAINED' not in markdown and all(f['reason'] for f in report['off_theory'])


@pytest.mark.slow
def test_bench_logs_each_compile_and_the_rounds(bench):
  stderr = (bench[2] / 'stderr.txt').read_text()
  for i, (mesh, mode) in enumerate([('data 8', 'auto'), ('data 8', 'manual'),
                                    ('fsdp 2 x tensor 4', 'auto'),
                                    ('fsdp 2 x tensor 4', 'manual')], 1):
    assert f'Compiling the train step, {mode} on {mesh} (variant {i} of 4) ...' in stderr
    assert f'Compiled the train step, {mode} on {mesh} (variant {i} of 4) in ' in stderr
  assert f"Compiled the baseline's variants (a child process, in {ROOT}) in " in stderr
  assert 'Interleaved steps (1 warm-up): round 3/3 done in ' in stderr


def test_the_rounds_log_each_compile_with_its_time(caplog):
  """run_variants, the loop of engine.bench, engine.analysis.compare and engine.analysis.bubble,
  on the tiny model on one device: a line as the compile starts, one with the time it took
  (the time the table reports), and the rounds' last line."""
  run = assemble(tiny_config(), jax.devices()[:1])
  caplog.set_level(logging.INFO, logger='absl')
  runs = benchmark.run_variants(run.config, run.corpus, [('auto', run.setup)], 1, warmup=1)
  lines = [r.getMessage() for r in caplog.records if r.name == 'absl']
  compiled = duration(runs[0].compile_seconds)
  assert lines[0] == 'Compiling the train step, auto on one device (variant 1 of 1) ...'
  assert f'Compiled the train step, auto on one device (variant 1 of 1) in {compiled}.' in lines
  assert lines[-1].startswith('Interleaved steps (1 warm-up): round 2/2 done in ')


def test_verbosity_minus_one_keeps_only_the_report():
  """The same lines from the command are absl INFO lines: --verbosity=-1 drops them all."""
  done = _bench('--modes=auto', '--steps=1', '--warmup=0', '--nocalibrate', '--verbosity=-1',
                devices=1)
  assert done.returncode == 0, done.stderr
  assert '| one device | auto |' in done.stdout
  assert not [line for line in done.stderr.splitlines() if line.startswith('I') or any(
      word in line for word in ('Compil', 'Interleaved'))], done.stderr


@pytest.mark.slow
def test_bench_sets_the_model_flops_against_a_calibrated_matmul(bench):
  report, markdown, _ = bench
  matmul = report['matmul_flops_per_device']
  assert 0 < matmul < float('inf')
  assert f'calibrated matmul: {matmul / 1e12:.4g} TFLOP/s per device' in markdown
  lines = markdown.splitlines()
  top = next(i for i, line in enumerate(lines) if line.startswith('| mesh | mode | median ms'))
  header = lines[top].split(' | ')
  assert len(report['variants']) == 8
  for r, line in zip(report['variants'], lines[top + 2:top + 10]):
    assert line.startswith(f'| {r["mesh"]} | {r["mode"]} |')
    achieved = report['model_flops_per_step'] / (r['median_ms'] / 1e3) / 8
    assert r['of_matmul'] == pytest.approx(achieved / matmul)
    assert line.split(' | ')[header.index('of matmul')] == f'{100 * achieved / matmul:.1f} %'


@pytest.mark.slow
def test_bench_with_a_baseline_times_the_other_checkouts_variants_too(bench):
  """--baseline=this tree's root: the same code on the same data, so the same losses."""
  report, markdown, _ = bench
  assert [(r['mesh'], r['mode'], r['baseline']) for r in report['variants']] == [
      (mesh, mode + suffix, bool(suffix)) for mesh in ('data 8', 'fsdp 2 x tensor 4')
      for suffix in ('', ' (baseline)') for mode in ('auto', 'manual')]
  rows = {(r['mesh'], r['mode']): r for r in report['variants']}
  pairs = report['baseline']['comparison']
  assert report['baseline']['directory'] == str(ROOT)
  assert [(p['mesh'], p['mode']) for p in pairs] == [
      (mesh, mode) for mesh in ('data 8', 'fsdp 2 x tensor 4') for mode in ('auto', 'manual')]
  for p in pairs:
    ours, theirs = rows[(p['mesh'], p['mode'])], rows[(p['mesh'], p['mode'] + ' (baseline)')]
    assert len(theirs['step_ms']) == 2 and len(theirs['losses']) == 3  # Warm-up's loss too.
    assert theirs['losses'] == ours['losses'] and p['max_loss_difference'] == 0
    assert theirs['collectives'] == ours['collectives']
    assert p['ratio'] == pytest.approx(ours['median_ms'] / theirs['median_ms'])
  table = markdown.split('This tree / baseline')[1].split('\n\n')[1].splitlines()
  assert table[-1] == (f'| fsdp 2 x tensor 4 | manual | {ours["median_ms"]:.1f} | '
                       f'{theirs["median_ms"]:.1f} | '
                       f'{ours["median_ms"] / theirs["median_ms"]:.3f} | 0 |')


@pytest.mark.slow
def test_a_failing_baseline_child_shows_the_end_of_its_stderr(tmp_path):
  from engine.bench import baseline  # pylint: disable=g-import-not-at-top
  (tmp_path / 'engine').mkdir()
  (tmp_path / 'engine' / '__init__.py').write_text('raise ImportError("out of cheese")\n')
  baseline.check_baseline(str(tmp_path))  # A checkout, as far as the flag's check can tell.
  with pytest.raises(RuntimeError) as raised:
    baseline.BaselineReference(str(tmp_path), '{}', [''], ['auto'])
  message = str(raised.value)
  assert f'the baseline ({tmp_path}) did not start (status 1)' in message
  assert message.endswith('ImportError: out of cheese')


def test_import_engine_applies_the_allocator_settings_unless_told_not_to():
  code = 'import engine.runtime.allocator as h, os; print(h.tune_malloc())'
  results = {}
  for value in ('1', '0'):
    env = dict(os.environ, ENGINE_TUNE_MALLOC=value)
    results[value] = subprocess.run([sys.executable, '-c', code], env=env, cwd=ROOT, check=True,
                                    capture_output=True, text=True).stdout.strip()
  assert results == {'1': 'True', '0': 'False'}


@pytest.mark.parametrize('device_kind, chip', [
    # Device kinds as JAX reports them (the TPU ones from libtpu's topologies).
    ('TPU v4', 'TPU v4'), ('TPU v5 lite', 'TPU v5e'), ('TPU v5', 'TPU v5p'),
    ('TPU v6 lite', 'TPU v6e'), ('NVIDIA H100 80GB HBM3', 'NVIDIA H100'),
    ('NVIDIA A100-SXM4-80GB', 'NVIDIA A100'), ('NVIDIA L4', 'NVIDIA L4'),
    ('NVIDIA L40S', None), ('cpu', None)])
def test_chips_are_recognised_by_device_kind(device_kind, chip):
  found = chips.chip_of(device_kind)
  assert (found.name if found else None) == chip


def test_peak_flops_follow_the_compute_dtype_or_the_flag():
  assert chips.peak_flops('TPU v5', 'bfloat16') == 459e12
  assert chips.peak_flops('NVIDIA H100 80GB HBM3', 'float32') == 495e12  # TF32.
  assert chips.peak_flops('cpu', 'float32') is None
  assert chips.peak_flops('cpu', 'float32', override_tflops=2.0) == 2e12


@pytest.mark.slow
def test_a_failing_torch_child_shows_the_end_of_its_stderr(tmp_path):
  from engine.analysis import benchmark  # pylint: disable=g-import-not-at-top
  from engine.config import default_config  # pylint: disable=g-import-not-at-top
  fake = tmp_path / 'python'  # Has "torch", then dies at start-up with something on stderr.
  fake.write_text('#!/bin/sh\ncase "$2" in "import torch") exit 0;; esac\n'
                  'for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo "noise $i" >&2; done\n'
                  'echo "RuntimeError: out of cheese" >&2\nexit 3\n')
  fake.chmod(0o755)
  benchmark.check_torch_python(str(fake))  # Imports torch: no error.
  with pytest.raises(RuntimeError) as raised:
    benchmark.TorchReference(str(fake), default_config().model, 256, 64, 16, 1)
  message = str(raised.value)
  assert 'did not start (status 3)' in message and message.endswith('out of cheese')
  assert 'noise 4\n' in message and 'noise 3\n' not in message  # The last 10 lines.


@pytest.mark.slow
def test_dense_equivalent_has_the_active_parameters_and_folds_the_expert_axis():
  """--dense_equivalent's model and mesh, and the side-by-side table of tokens/s."""
  from engine.analysis import benchmark
  from engine.assemble import lay_out
  from tests.support.helpers import tiny_config
  config = tiny_config(mesh=(2, 1, 1))
  config.mesh.expert = 4
  config.model.name, config.model.num_experts, config.model.experts_per_token = 'llama', 8, 2
  config.model.moe_mlp_dim, config.model.moe_shared_expert = 48, 16
  dense = benchmark.dense_equivalent(config)
  assert dense.model.mlp_dim == 2 * 48 + 16 and dense.model.num_experts == 0
  assert (dense.mesh.data, dense.mesh.expert) == (8, 1) and config.mesh.expert == 4
  # Active weights per token: a dense layer's MLP has as many as k experts and the shared one;
  # the MoE's router (D x E per layer) is the only difference in the model FLOPs.
  moe_flops = lay_out(config, 256).model.flops_per_token(64)
  dense_flops = lay_out(dense, 256).model.flops_per_token(64)
  D, layers = config.model.embed_dim, config.model.num_layers
  assert moe_flops - dense_flops == pytest.approx(6 * layers * D * 8)
  config.model.num_experts = 0
  with pytest.raises(ConfigError, match='not a mixture of experts'):
    benchmark.dense_equivalent(config)
  row = lambda mesh, shape, tokens, dense: {'mesh': mesh, 'mode': 'manual', 'mesh_shape': shape,
                                            'tokens_per_s': tokens, 'dense_equivalent': dense}
  table = benchmark.dense_comparison([
      row('data 2 x expert 4', {'data': 2, 'expert': 4}, 300.0, False),
      row('data 8', {'data': 8, 'expert': 1}, 1200.0, True)])
  assert table.splitlines()[-1] == '| data 2 x expert 4 | manual | 300 | data 8 | 1,200 | 0.25 |'


class _Event:
  def __init__(self, start, end, name):
    self.start_ns, self.duration_ns, self.name = start, end - start, name


def test_op_self_times_subtract_nested_events():
  """A [0, 10] holds B [2, 5] and C [6, 8]; D [12, 13] after them; B and C are both `fusion`."""
  totals = collections.Counter()
  op_profile._add_self_times([_Event(6, 8, 'fusion.2'), _Event(0, 10, 'while.1'),
                              _Event(12, 13, 'all-reduce.3'), _Event(2, 5, 'fusion.1')], totals)
  assert dict(totals) == {'while': 5, 'fusion': 5, 'all-reduce': 1}
  assert op_profile.split({'fusion': 2.0, 'all-reduce': 1.0, 'Rendezvous': 0.5}) == {
      'compute': 2.0, 'collectives': 1.0, 'waiting': 0.5}
