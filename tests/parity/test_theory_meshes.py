"""Manual mode moves exactly the bytes of the communication theory on every layout the suite
runs, and the reports flag what does not."""

import jax
import pytest

from engine.analysis import comm_theory, verdicts
from engine.analysis.benchmark import ModeRun
from engine.analysis import collectives
from engine.parallel import manual_ops
from tests.support.helpers import compiled_train_step, tiny_config

# (data, fsdp, tensor, context, stage, expert), and what the layout needs of the tiny model.
MESHES = {
    'data': ((8, 1, 1, 1, 1, 1), {}),
    'fsdp': ((1, 8, 1, 1, 1, 1), {}),
    'tensor': ((1, 1, 8, 1, 1, 1), {'model.num_heads': 8}),
    'data x fsdp x tensor': ((2, 2, 2, 1, 1, 1), {}),
    # Llama's untied embedding looked up on each device's columns (tokens and rows exchanged;
    # also 'fsdp x expert' below), and its chunked loss' head exchanged to a slice of the
    # vocabulary, each chunk's features gathered.
    'data x fsdp x tensor, llama, chunked loss': ((2, 2, 2, 1, 1, 1), {
        'model.name': 'llama', 'model.loss_chunks': 4}),
    'fsdp, per-weight gathers': ((2, 2, 2, 1, 1, 1), {'parallelism.fsdp_gather': 'per_weight'}),
    'fsdp, micro-batches': ((2, 2, 2, 1, 1, 1), {'train.microbatches': 2}),
    'fsdp, int8 gathers': ((2, 2, 2, 1, 1, 1), {'parallelism.gather_dtype': 'int8'}),
    'fsdp, int8 gathers, full remat': ((1, 8, 1, 1, 1, 1), {'parallelism.gather_dtype': 'int8',
                                                            'model.remat': 'full'}),
    'fsdp x stage, fp8 gathers': ((1, 4, 1, 1, 2, 1), {'train.microbatches': 2,
                                                       'parallelism.gather_dtype': 'fp8'}),
    'context': ((4, 1, 1, 2, 1, 1), {'model.name': 'llama', 'model.num_kv_heads': 2}),
    'context x tensor': ((2, 1, 2, 2, 1, 1), {'model.name': 'llama', 'model.num_kv_heads': 2}),
    'stage': ((4, 1, 1, 1, 2, 1), {'train.microbatches': 2}),
    'fsdp x stage': ((1, 4, 1, 1, 2, 1), {'train.microbatches': 2}),
    'fsdp x tensor x stage': ((1, 2, 2, 1, 2, 1), {'train.microbatches': 2}),
    'tensor x stage, circular': ((2, 1, 2, 1, 2, 1), {'train.microbatches': 2,
                                                       'train.pipeline_repeats': 2,
                                                       'model.num_layers': 4}),
    'expert': ((4, 1, 1, 1, 1, 2), {'model.name': 'llama', 'model.num_experts': 4,
                                    'model.moe_mlp_dim': 32}),
    'fsdp x expert': ((1, 4, 1, 1, 1, 2), {'model.name': 'llama', 'model.num_experts': 4,
                                           'model.moe_mlp_dim': 32}),
    'data, zero1': ((8, 1, 1, 1, 1, 1), {'parallelism.optimizer_sharding': 'zero1'}),
    'data x fsdp x tensor, zero1': ((2, 2, 2, 1, 1, 1), {
        'parallelism.optimizer_sharding': 'zero1'}),
    # Muon: the layers' matrices gathered over tensor, the experts' exchanged over it.
    'tensor x stage x expert, muon': ((1, 1, 2, 1, 2, 2), {
        'optim.name': 'muon', 'model.name': 'llama', 'model.num_experts': 4,
        'model.moe_mlp_dim': 32, 'train.microbatches': 2}),
    'tensor x expert, a dense first layer': ((2, 1, 2, 1, 1, 2), {
        'model.name': 'llama', 'model.num_experts': 4, 'model.moe_mlp_dim': 32,
        'model.moe_dense_layers': 1}),
    'stage x expert, a dense first layer': ((2, 1, 1, 1, 2, 2), {
        'model.name': 'llama', 'model.num_experts': 4, 'model.moe_mlp_dim': 32,
        'model.moe_dense_layers': 1, 'model.num_layers': 3, 'train.microbatches': 2}),
}


def _config(mesh, settings, **more):
  config = tiny_config(mesh=mesh[:3])
  config.mesh.context, config.mesh.stage, config.mesh.expert = mesh[3:]
  for key, value in {**settings, **more}.items():
    section, name = key.split('.')
    config[section][name] = value
  return config


def _flags(config, mode='manual'):
  setup, compiled = compiled_train_step(config, mode)
  theory = comm_theory.expected_bytes(setup, config.data.global_batch_size, config.data.seq_len)
  run = ModeRun(mode, setup, compiled, 0.0, {},
                collectives.count_collectives(compiled.as_text(), setup.mesh))
  rows = verdicts.communication_table([run], theory)
  return rows, verdicts.off_theory(rows, [mode], verdicts.context_for(setup, config))


@pytest.mark.slow
@pytest.mark.parametrize('name', list(MESHES))
def test_manual_bytes_are_the_theory(name):
  mesh, settings = MESHES[name]
  rows, flags = _flags(_config(mesh, settings))
  assert not flags, [f.describe() for f in flags]
  assert any(row['theory_bytes'] for row in rows)  # Something moves on every one of them.


@pytest.mark.slow
def test_a_gradient_reduced_twice_is_flagged_unexplained(monkeypatch):
  original = manual_ops.average_over_batch

  def twice(grad, replicated_axes, *rest):  # The planted bug: a second all-reduce.
    once = original(grad, replicated_axes, *rest)
    return original(once, replicated_axes, *rest)

  monkeypatch.setattr(manual_ops, 'average_over_batch', twice)
  _, flags = _flags(_config(*MESHES['data']))
  assert [(f.kind, f.axes, f.explained) for f in flags] == [('all-reduce', 'data', False)]
  assert flags[0].ratio == pytest.approx(2.0)


@pytest.mark.slow
def test_written_out_layers_on_cpu_gather_once_and_the_report_says_why():
  """XLA:CPU merges the backward re-gather of layers written out with the forward gather: the
  bytes are the theory's without re-gathers, and the flag says so, with the memory it costs."""
  assert jax.devices()[0].platform == 'cpu'
  rows, flags = _flags(_config(*MESHES['data x fsdp x tensor'], **{'model.scan_layers': False}))
  assert [(f.kind, f.axes) for f in flags] == [('all-gather', 'fsdp')]
  assert flags[0].explained and 'scan_layers=True' in flags[0].reason
  assert 0.5 < flags[0].ratio < 0.7  # One gather per layer of the two the theory counts.
