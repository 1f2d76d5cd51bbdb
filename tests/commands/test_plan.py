"""engine.plan: the real train step compiled for a TPU topology (libtpu's compiler, on CPU)."""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from engine.plan import planner as plan_lib
from engine.plan import report as plan_report
from engine.plan import step_flops
from engine.analysis import comm_theory
from engine.errors import ConfigError
from engine.main import run as run_main
from engine.mesh import make_mesh
from engine.assemble import lay_out
from experiments import tiny as tiny_experiment
from tests.support.helpers import collective_table, compiled_train_step, tiny_config

pytestmark = pytest.mark.usefixtures('without_persistent_cache')  # Each compiled once.

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPOLOGY = 'v5p:2x2x2'  # 8 chips: the same device count as the CPU tests' simulated mesh.


def _config(model='gpt', width=1024):
  """Two layers, but wide enough (1024, an MLP as wide) that TPU's (8, 128) tiles pad nothing
  even when fsdp splits a dimension eight ways; a narrower `width` where fewer ways split it or
  none (a TPU compile takes longer the wider the model)."""
  config = tiny_config(mesh=(8, 1, 1), steps=2)
  config.model.name = model
  config.model.embed_dim, config.model.mlp_dim, config.model.num_heads = width, width, 8
  config.model.vocab_size = 1024
  if model == 'llama':
    config.model.num_kv_heads = 2
  return config


@pytest.fixture(scope='module')
def gpt_plan():
  """Data 8 and fsdp 8 in both modes, each with its memory breakdown."""
  return plan_lib.plan(_config(), TOPOLOGY, 1, ['auto', 'manual'], ['8x1x1', '1x8x1'],
                       memory_breakdown=True)


def _cpu_collectives(config, mode):
  """The same layout compiled for this machine's 8 simulated devices."""
  table = collective_table(*compiled_train_step(config, mode, config.model.vocab_size))
  return {key: row['array_bytes'] for key, row in table.items() if row['array_bytes']}


def _tpu_collectives(row):
  return {(r['kind'], tuple(r['axes'].split(',')) if r['axes'] != '-' else ()):
          r[row['mode']]['bytes'] for r in row['communication'] if r[row['mode']]['bytes']}


@pytest.mark.slow
def test_gpt_plan_fits_ranks_and_falls_with_fsdp(gpt_plan):
  rows = gpt_plan['candidates']
  assert gpt_plan['chip'] == 'TPU v5p' and gpt_plan['devices'] == 8
  assert [r['status'] for r in rows] == ['fits'] * 4
  assert sorted(r['rank'] for r in rows) == [1, 2, 3, 4]
  by = {(r['mesh'], r['mode']): r for r in rows}
  for mode in ('auto', 'manual'):
    data, fsdp = by[('data 8', mode)], by[('fsdp 8', mode)]
    # Parameters and optimizer state: whole on every device under data parallelism, an eighth
    # under fsdp (the batch and a few scalars aside).
    ratio = fsdp['memory']['argument_size_in_bytes'] / data['memory']['argument_size_in_bytes']
    assert 0.12 < ratio < 0.2, ratio
    for row in (data, fsdp):
      estimate = row['roofline']
      assert estimate['serial_s'] >= estimate['overlapped_s'] > 0
      assert estimate['ici_s'] > 0 and estimate['dcn_s'] == 0
      assert 0 < row['mfu'] <= row['mfu_overlapped'] <= 1
  report = plan_report.markdown(gpt_plan, 'experiments/tiny.py')
  assert report.count('Train it: `python -m engine.main --config=experiments/tiny.py') == 4
  # Right under the ranking: the collectives off their theory, every one explained.
  assert report.index('## Collectives off their theory') < report.index('## data 8, auto')
  assert 'UNEXPLAINED' not in report


@pytest.mark.slow
def test_tpu_collectives_against_the_cpu_compile(gpt_plan):
  """Manual mode's collectives on TPU, read from the TPU HLO (no recorded loop trip counts,
  async permutes), against the CPU compile of the same layout."""
  rows = {r['mesh_shape']['data']: r for r in gpt_plan['candidates'] if r['mode'] == 'manual'}
  # Every loop's trip count read off the TPU HLO: no count is a lower bound.
  assert not any(c[r['mode']]['lower_bound'] for r in gpt_plan['candidates']
                 for c in r['communication'])
  config = _config()
  # Data parallel: the same all-reduces, byte for byte.
  assert _tpu_collectives(rows[8]) == _cpu_collectives(config, 'manual')
  # FSDP: XLA:TPU turns each gradient's reduce-scatter into an all-reduce of the whole gradient
  # (then keeps its shard), and gathers each weight once per step where the CPU compile gathers
  # it again for the backward pass: the plan's report says so.
  config.mesh.data, config.mesh.fsdp = 1, 8
  tpu, cpu = _tpu_collectives(rows[1]), _cpu_collectives(config, 'manual')
  key = lambda kind: (kind, ('fsdp',))
  assert key('reduce-scatter') not in tpu
  assert tpu[key('all-reduce')] == 8 * cpu[key('reduce-scatter')] + cpu[key('all-reduce')]
  # Each weight gathered once: the whole of every sharded parameter (an eighth of it held).
  assert tpu[key('all-gather')] == 8 * cpu[key('reduce-scatter')] < cpu[key('all-gather')]


@pytest.mark.slow
def test_llama_on_fsdp_x_tensor_and_the_plan_config_trains(tmp_path):
  overrides = ['--config.model.name=llama', '--config.model.num_kv_heads=2',
               '--config.data.source=synthetic', '--config.train.num_steps=2']
  config = tiny_experiment.get_config()
  config.model.name, config.model.num_kv_heads = 'llama', 2
  config.data.source, config.train.num_steps = 'synthetic', 2
  result = plan_lib.plan(config, TOPOLOGY, 1, ['manual'], ['1x4x2'])
  (row,) = result['candidates']
  assert row['status'] == 'fits' and row['mesh'] == 'fsdp 4 x tensor 2'
  # The plan records the exact config, and the command it prints trains it (here, on 8
  # simulated devices).
  command = plan_report.train_command('experiments/tiny.py', overrides, row['mesh_shape'],
                                   row['mode'], ml_collections.ConfigDict(row['config']))
  argv = command.replace('WORKDIR', str(tmp_path / 'run')).split()[3:]
  assert run_main(argv) == 0
  saved = json.loads((tmp_path / 'run' / 'config.json').read_text())
  for section in ('model', 'data', 'mesh', 'parallelism', 'train', 'optim'):
    assert saved[section] == row['config'][section], section


@pytest.mark.slow
def test_a_model_too_large_does_not_fit():
  config = _config('llama')
  config.model.embed_dim, config.model.mlp_dim, config.model.num_heads = 8192, 32768, 64
  config.model.num_layers, config.model.vocab_size = 16, 32768
  result = plan_lib.plan(config, TOPOLOGY, 1, ['auto'], ['8x1x1'], memory_breakdown=True)
  (row,) = result['candidates']
  assert row['status'] == 'does not fit'
  assert row['memory']['peak_estimate_bytes'] > result['hbm_bytes_per_device']
  # The compiler's memory layout says what the total it reported is made of.
  peak = row['peak_memory']
  assert peak['total_bytes'] == pytest.approx(row['memory']['peak_estimate_bytes'], rel=1e-3)
  sizes = [c['bytes'] for c in peak['chunks']]
  assert sizes == sorted(sizes, reverse=True) and sum(sizes) <= 1.01 * peak['total_bytes']
  assert any(c['op_name'] for c in peak['chunks'])
  assert f'{row["mesh"]}, auto: memory at the peak' in plan_report.markdown(result, 'x')
  del row['peak_memory']  # Planned without the flag, the report points to it.
  assert '`--memory_breakdown` lists the buffers' in plan_report.markdown(result, 'x')


@pytest.mark.slow
def test_the_memory_breakdown_of_a_step_that_fits(gpt_plan):
  """Its chunks lie between the compiled temporaries and the peak (arguments too), and the
  largest name the step's own operations."""
  for row in gpt_plan['candidates']:
    memory, peak = row['memory'], row['peak_memory']
    assert row['status'] == 'fits'
    assert memory['temp_size_in_bytes'] <= peak['total_bytes'] <= memory['peak_estimate_bytes']
    assert 'train_step' in peak['chunks'][0]['op_name']


def test_a_mesh_that_splits_the_torus_axes_is_laid_out():
  """8 x 8 on a 4x4x4 torus: no product of whole physical axes is 8, so the mesh splits one
  (jax.make_mesh alone refuses)."""
  devices = plan_lib.topology_devices('v5p:4x4x4')
  mesh = make_mesh(ml_collections.ConfigDict({'data': 1, 'fsdp': 8, 'tensor': 8}), devices)
  assert dict(mesh.shape)['fsdp'] == dict(mesh.shape)['tensor'] == 8
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@pytest.mark.parametrize('topology, message', [
    ('v5p-8', "--topology='v5p-8' is not a TPU topology; write VERSION:SHAPE"),
    ('v5p:3x3x3', "--topology='v5p:3x3x3' is not a topology libtpu knows"),
])
def test_unknown_topology_is_one_error_line(topology, message):
  with pytest.raises(ConfigError, match=message):
    plan_lib.topology_devices(topology)
  if topology == 'v5p-8':  # The command line: one line, exit 2, nothing compiled.
    proc = subprocess.run(
        [sys.executable, '-m', 'engine.plan', '--config=experiments/tiny.py',
         f'--topology={topology}'], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f'error: {message}')


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['none', 'full'])
def test_executed_flops_match_the_compiled_unrolled_step(remat):
  """The roofline's compute FLOPs (XLA's cost analysis counts a scanned layer once) against
  XLA's own count for the same step with its layers unrolled."""
  config = tiny_config(mesh=(8, 1, 1))
  config.model.name, config.model.remat, config.model.scan_layers = 'llama', remat, False
  config.model.embed_dim, config.model.mlp_dim, config.model.num_heads = 512, 2048, 8
  config.model.num_layers, config.model.vocab_size = 4, 1024
  config.data.seq_len = config.model.max_len = 128
  config.data.global_batch_size = 8
  train_setup, compiled = compiled_train_step(config, 'auto', 1024)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  model_flops = train_setup.model.flops_per_token(128) * 8 * 128
  per_device = step_flops.executed_flops(model_flops, config, train_setup) / 8
  assert cost['flops'] == pytest.approx(per_device, rel=0.08)


@pytest.mark.slow
@pytest.mark.parametrize('schedule, head', [('1f1b', 'split'), ('1f1b', 'last_stage'),
                                            ('zb_h1', 'split')])
def test_executed_flops_count_1f1b_recompute_and_the_heads_it_runs(schedule, head):
  """data 2 x stage 4, 1F1B, layers unrolled: the stages' second forward pass, the bubble, and
  the head once in all (split over the stages) or once per stage, against XLA's count; the
  zero-bubble schedule's smaller bubble (its weight passes in 4 ticks, not 7) likewise."""
  config = tiny_config(mesh=(2, 1, 1))
  config.mesh.stage, config.train.microbatches = 4, 4
  config.train.pipeline_schedule, config.train.pipeline_head = schedule, head
  config.model.name, config.model.scan_layers = 'llama', False
  config.model.embed_dim, config.model.mlp_dim, config.model.num_heads = 256, 1024, 8
  config.model.num_layers, config.model.vocab_size = 4, 4096
  config.data.seq_len = config.model.max_len = 64
  config.data.global_batch_size = 32  # 4 rows per device and micro-batch: one per stage.
  train_setup, compiled = compiled_train_step(config, 'manual', 4096)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  model_flops = train_setup.model.flops_per_token(64) * 32 * 64
  assert step_flops.head_copies(train_setup, config) == (1 if head == 'split' else 4)
  per_device = step_flops.executed_flops(model_flops, config, train_setup) / 8
  assert cost['flops'] == pytest.approx(per_device, rel=0.08)


@pytest.mark.slow
def test_1f1b_fsdp_gathers_a_stage_per_tick_as_the_theory_counts():
  """fsdp 4 x stage 2, 1F1B over 4 micro-batches: each of the 5 forward ticks gathers the
  stage's layers once and each of the 5 backward ticks twice; XLA:TPU gathers them in the
  matmuls' bfloat16, half the theory's float32 bytes, which the plan names as the reason."""
  config = _config('llama', width=512)
  config.model.num_layers, config.data.global_batch_size = 4, 16
  config.train.pipeline_schedule, config.train.microbatches = '1f1b', 4
  result = plan_lib.plan(config, TOPOLOGY, 1, ['manual'], ['1x4x1x1x2'])
  (row,) = result['candidates']
  gathers = next(r for r in row['communication']
                 if (r['kind'], r['axes']) == ('all-gather', 'fsdp'))
  assert gathers['manual']['bytes'] == pytest.approx(gathers['theory_bytes'] / 2, rel=0.05)
  assert not any(f['kind'] == 'all-gather' and f['reason'] is None for f in row['off_theory'])


def test_two_slices_are_refused_without_an_axis_across_them():
  """The slices must be joined along some axis (mesh.dcn_data or mesh.dcn_fsdp): with no other
  candidate, the plan is refused in one line. (Two slices' traffic: test_plan_search.py.)"""
  with pytest.raises(ConfigError, match=r'no candidate can run on v5p:2x2x1; the first, mesh '
                     r'2x4x1x1x1x1: .*number of TPU slices \(2\)'):
    plan_lib.plan(_config(), 'v5p:2x2x1', 2, ['manual'], ['2x4x1'])


@pytest.mark.slow
def test_moe_plan_carries_the_all_to_all_bytes_and_the_padded_expert_flops():
  """A mixture of experts on expert 8: each row's all-to-all bytes are the theory's
  (comm_theory), both modes compile exactly those (the dropless exchange, auto mode's in a
  shard_map), and the compute FLOPs count only the routed rows, while XLA's count of the
  unrolled step also has the exchanged blocks' unused rows (8 x min(2, 8 / 8) / 2 = 4 times the
  routed rows here), which TPU's grouped-matmul kernel skips."""
  config = _config('llama', width=256)
  config.model.num_experts, config.model.experts_per_token, config.model.moe_mlp_dim = 8, 2, 256
  config.model.scan_layers = False  # XLA's cost analysis then counts every layer.
  result = plan_lib.plan(config, TOPOLOGY, 1, ['auto', 'manual'], ['1x1x1x1x1x8'])
  setup = lay_out(plan_lib.ml_collections.ConfigDict(result['candidates'][0]['config']), 1024,
                  plan_lib.topology_devices(TOPOLOGY))
  theory = comm_theory.expected_bytes(setup, 16, 16)[('all-to-all', ('expert',))]
  # Dropless: 8 blocks of min(2, 8 / 8) rows per local token (32), width 256, float32, each
  # way, forward (no remat) and backward, 2 layers (ragged all-to-alls, counted at their whole
  # buffer); plus the forward's int32 counts per expert [8] and the two int32 offset vectors [8]
  # the backward's ragged moves exchange (on CPU: each row's int32 expert id instead).
  assert theory == 2 * (4 * 8 * 32 * 256 * 4 + 8 * 4 + 2 * 8 * 4)
  # Useful routed FLOPs per step: 6 x (2 layers x 2 of 8 experts x 3 x 256 x 256) x 256 tokens.
  useful = 6 * 2 * 2 * 3 * 256 * 256 * 256
  for row in result['candidates']:
    assert row['status'] == 'fits' and row['all_to_all_bytes']['theory'] == theory
    assert row['expert_padding_flops_per_step'] == 0
    executed = step_flops.executed_flops(row['model_flops_per_step'] + 3 * useful, config,
                                         setup) / 8
    assert row['roofline']['compiled_flops_per_device'] == pytest.approx(executed, rel=0.05)
  compiled = {row['mode']: row['all_to_all_bytes']['compiled'] for row in result['candidates']}
  # Auto mode's compiled step exchanges one int32 offset vector [8] a layer fewer (2 int32
  # all-to-alls a layer against manual mode's 3).
  assert compiled['manual'] == theory and compiled['auto'] == pytest.approx(theory, abs=64)
  assert '| all-to-all MiB (theory / compiled) |' in plan_report.markdown(result, 'x')


@pytest.mark.slow
def test_int8_projections_compile_to_int8_matmuls_timed_at_the_int8_peak():
  """The quantized step for TPU v5p: its projections' matmuls take int8 operands in the HLO (the
  head's and attention's stay bfloat16), and the roofline times their FLOPs at v5p's int8 peak
  (twice bfloat16's), so compute falls by half their share against the unquantized step."""
  config = _config(width=256)
  config.model.dtype = 'bfloat16'
  # Blocks of 128 (the sequence too): libtpu compiles smaller ones to bfloat16 matmuls.
  config.model.matmul_precision, config.model.matmul_block = 'int8', 128
  config.data.seq_len = config.model.max_len = 128
  (row,) = plan_lib.plan(config, TOPOLOGY, 1, ['manual'], ['8x1x1'])['candidates']
  # GPT's 6 projections (q, k, v, out, up, down) x 3 products, once in the scanned layer's
  # forward and backward loop bodies.
  assert row['matmul_types'].get('s8 x s8', 0) == 6 * 3
  assert row['matmul_types'].get('bf16 x bf16', 0) > 0
  estimate = row['roofline']
  quantized = step_flops.quantized_flops(lay_out(config, config.model.vocab_size), config) / 8
  assert 0 < quantized < estimate['flops_per_device']
  peak = 459e12  # v5p bfloat16; int8: 918.
  assert estimate['compute_s'] == pytest.approx(
      (estimate['flops_per_device'] - quantized) / peak + quantized / (2 * peak), rel=1e-9)
  assert 's8 x s8' in plan_report.markdown({**{'candidates': [row]}, 'topology': TOPOLOGY,
                                            'num_slices': 1, 'devices': 8, 'chip': 'TPU v5p',
                                            'hbm_bytes_per_device': 1}, 'x')


@pytest.mark.slow
def test_offloaded_optimizer_state_shows_in_the_host_column():
  """parallelism.offload_optimizer for TPU v5p: the device arguments lose what the host gains,
  the roofline times the state's trip to the chip and back over the host link (--host_gb_per_s),
  and the report adds its host columns only then."""
  rows = {}
  for offload in (False, True):
    config = tiny_config(mesh=(8, 1, 1), steps=2)
    config.parallelism.offload_optimizer = offload
    result = plan_lib.plan(config, TOPOLOGY, 1, ['manual'], ['8x1x1'], host_gb_per_s=10)
    (rows[offload],) = result['candidates']
    report = plan_report.markdown(result, 'x')
    assert ('host GiB' in report) == ('host ms' in report) == offload
  moved = (rows[False]['memory']['argument_size_in_bytes'] -
           rows[True]['memory']['argument_size_in_bytes'])
  assert rows[True]['memory']['host_argument_size_in_bytes'] == moved > 0
  roof = rows[True]['roofline']
  devices_per_chip = result['devices_per_chip']
  assert roof['host_s'] == pytest.approx(2 * moved / (10e9 / devices_per_chip), rel=1e-9)
  assert roof['serial_s'] == pytest.approx(
      max(roof['compute_s'], roof['memory_s']) + roof['ici_s'] + roof['dcn_s'] + roof['host_s'])
  assert rows[False]['roofline']['host_s'] == 0
