"""The collective counter, on hand-written HLO and on the compiled manual steps."""

import collections
import math

import jax
import pytest

from engine import parallel
from engine.analysis import collectives
from engine.train.metrics import log_memory
from engine.models.ops import LAYERS
from engine.sharding import spec_axes
from engine.assemble import lay_out
from tests.support.helpers import compiled_train_step, tiny_config

MESH_222 = {'data': 2, 'fsdp': 2, 'tensor': 2}


class _Mesh:
  def __init__(self, shape):
    self.shape = shape


@pytest.mark.parametrize('groups, axes', [
    ('replica_groups={{0,1},{2,3},{4,5},{6,7}}', ('tensor',)),
    ('replica_groups={{0,2},{1,3},{4,6},{5,7}}', ('fsdp',)),
    ('replica_groups={{0,2,4,6},{1,3,5,7}}', ('data', 'fsdp')),
    ('replica_groups=[4,2]<=[8]', ('tensor',)),
    ('replica_groups=[4,2]<=[2,2,2]T(1,2,0)', ('data',)),
    ('replica_groups=[2,4]<=[2,2,2]T(2,0,1)', ('data', 'fsdp')),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}",
     ('fsdp',)),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", ('data', 'fsdp')),
])
def test_replica_group_spellings_map_to_mesh_axes(groups, axes):
  line = f'  %ar = f32[4,8]{{1,0}} all-reduce(%x), channel_id=1, {groups}, to_apply=%add'
  found = collectives.count_collectives(f'ENTRY %main (x: f32[4,8]) -> f32[4,8] {{\n{line}\n}}',
                                        _Mesh(MESH_222))
  assert [(c.kind, c.axes, c.bytes) for c in found] == [('all-reduce', axes, 128)]


def test_loop_bodies_count_once_per_iteration_and_tuples_per_buffer():
  hlo = '\n'.join([
      '%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {',
      '  %ag = f32[16]{0} all-gather(%x), replica_groups=[4,2]<=[8], dimensions={0}',
      '}',
      'ENTRY %main.2 (a: f32[8]) -> f32[8] {',
      '  %w = (s32[], f32[8]) while(%t), condition=%cond.1, body=%body.1, '
      'backend_config={"known_trip_count":{"n":"6"}}',
      '  %ar = (f32[8]{0}, s8[2,3]{1,0}, f32[]) all-reduce(%a, %b, %c), '
      'replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add',
      '}'])
  table = collectives.summarize(collectives.count_collectives(hlo, _Mesh(MESH_222)))
  assert table[('all-gather', ('tensor',))] == {'ops': 1, 'executions': 6, 'buffers': 6,
                                                'bytes': 6 * 64, 'array_bytes': 6 * 64,
                                                'dtype_bytes': {'f32': 6 * 64},
                                                'ops_in_unknown_loops': 0}
  assert table[('all-reduce', ('data',))] == {'ops': 1, 'executions': 1, 'buffers': 3,
                                              'bytes': 32 + 6 + 4, 'array_bytes': 32 + 6,
                                              'dtype_bytes': {'f32': 32, 's8': 6},
                                              'ops_in_unknown_loops': 0}


def _compiled_manual_step(mesh, fsdp_gather='auto', **model):
  config = tiny_config(mesh=mesh)
  config.model.update(model)
  config.parallelism.fsdp_gather = fsdp_gather
  train_setup = lay_out(config, 256)
  steps = parallel.build_steps('manual', train_setup)
  batch = train_setup.abstract_batch(config.data.global_batch_size, config.data.seq_len)
  compiled = steps.train.lower(train_setup.abstract_state(), batch).compile()
  return (compiled, collectives.count_collectives(compiled.as_text(), train_setup.mesh),
          train_setup)


def _param_shapes(train_setup):
  return sorted(tuple(p.shape) for p in jax.tree.leaves(train_setup.abstract_params))


def _reduced_per_step(found, kind='all-reduce'):
  """Buffer shape -> how often a step reduces one of that shape (loop iterations counted)."""
  reduced = collections.Counter()
  for c in found:
    if c.kind == kind:
      for shape in c.shapes:
        if shape != ():
          reduced[shape] += c.executions
  return reduced


def _each_once(params):
  """What `_reduced_per_step` finds when each of `params` is reduced once per step: a stacked
  layer's gradients one layer at a time, inside the backward loop as they are produced."""
  expected = collections.Counter()
  for p in params:
    if LAYERS in p.logical_axes:
      expected[tuple(p.shape[1:])] += p.shape[0]
    else:
      expected[tuple(p.shape)] += 1
  return expected


@pytest.mark.slow
def test_data_parallel_step_all_reduces_each_gradient_once_where_it_is_produced():
  _, found, train_setup = _compiled_manual_step((8, 1, 1))
  assert {(c.kind, c.axes) for c in found} == {('all-reduce', ('data',))}
  assert _reduced_per_step(found) == _each_once(train_setup.parameters())  # Never twice.
  assert any(c.executions == train_setup.model.num_layers for c in found)  # In the loop.
  assert all(c.trip_count_known for c in found)  # Every loop's count exact, none a lower bound.


@pytest.mark.slow
def test_tensor_parallel_step_has_two_all_reduces_per_block_each_way():
  config_layers = 2
  _, found, _ = _compiled_manual_step((1, 1, 8), num_heads=8, num_layers=config_layers)
  assert {(c.kind, c.axes) for c in found} == {('all-reduce', ('tensor',))}
  # [batch, length, embed] (or batch x length flattened by a matmul): the batch is not split
  # over tensor.
  activations = {(16, 16, 32), (16 * 16, 32)}
  per_loop = {}
  for c in found:
    if c.executions == config_layers:
      assert len(c.shapes) == 1 and c.shapes[0] in activations
      per_loop[c.computation] = per_loop.get(c.computation, 0) + 1
  assert sorted(per_loop.values()) == [2, 2]  # Forward scan body and backward scan body.
  assert not any(s and s[-1] == 256 for c in found for s in c.shapes)  # Logits never gathered.


@pytest.mark.slow
@pytest.mark.parametrize('fsdp_gather', ['auto', 'per_weight'])
def test_fsdp_step_gathers_parameters_and_reduce_scatters_gradients(fsdp_gather):
  _, found, train_setup = _compiled_manual_step((1, 8, 1), fsdp_gather)
  kinds = {c.kind for c in found}
  assert kinds == {'all-gather', 'reduce-scatter', 'all-reduce'}
  assert all(c.axes == ('fsdp',) for c in found)
  params = train_setup.parameters()
  sharded_params = [p for p in params if 'fsdp' in spec_axes(p.spec)]
  replicated = [p for p in params if 'fsdp' not in spec_axes(p.spec)]
  # Exactly the replicated parameters' gradients (norms, biases) are all-reduced, each once; a
  # full gradient of a sharded parameter would be one buffer too many.
  assert _reduced_per_step(found) == _each_once(replicated)
  assert sharded_params
  layers = tiny_config().model.num_layers
  in_layers = lambda kind: [c.shapes for c in found if c.kind == kind and c.executions == layers]
  if fsdp_gather == 'per_weight':
    # Each layer weight gathered once per layer in the forward pass and again in the backward
    # one, and its gradient reduce-scattered once.
    w_up = (32, 64)  # Full per-layer shape of blocks/w_up_DF.
    assert in_layers('all-gather').count((w_up,)) == 2
    assert in_layers('reduce-scatter').count(((4, 64),)) == 1
    return
  # On CPU devices (auto) a layer's split weights travel together (flat_gather.py): one
  # all-gather of every device's shards, flat, per layer in the forward pass and again in the
  # backward one, and one reduce-scatter of their gradients.
  per_layer = sum(math.prod(p.shape) for p in params
                  if LAYERS in p.logical_axes and 'fsdp' in spec_axes(p.spec)) // layers
  assert in_layers('all-gather') == [((8, per_layer // 8),)] * 2
  assert in_layers('reduce-scatter') == [((1, per_layer // 8),)]
  # Outside the layers, the embeddings' tables: gathered once, together, and scattered once.
  top = sum(math.prod(p.shape) for p in sharded_params if LAYERS not in p.logical_axes)
  assert [c.shapes for c in found if c.kind == 'all-gather' and c.executions == 1] == [
      ((8, top // 8),)]


@pytest.mark.slow
def test_fsdp_memory_falls_with_the_fsdp_axis():
  arguments = []
  for fsdp in (1, 2, 4, 8):
    compiled, _, _ = _compiled_manual_step((8 // fsdp, fsdp, 1), embed_dim=64, mlp_dim=256)
    memory = log_memory(f'fsdp={fsdp}', compiled)
    arguments.append(memory['argument_size_in_bytes'])
  assert arguments == sorted(arguments, reverse=True) and len(set(arguments)) == 4
  assert arguments[-1] < arguments[0] / 4


@pytest.mark.slow
def test_auto_mode_reads_a_vocab_parallel_embedding_without_a_matmul():
  # A one-hot matmul lookup costs 2*B*L*V*D FLOPs forward and as many for the table's gradient;
  # the masked local lookup that manual mode writes costs none, and so must auto mode's.
  flops = {}
  for mode in ('auto', 'manual'):
    config = tiny_config(mesh=(1, 1, 8))
    config.model.num_heads = 8
    _, compiled = compiled_train_step(config, mode)
    flops[mode] = compiled.cost_analysis()['flops']
  one_hot_forward = 2 * 16 * 16 * 256 * 32 / 8  # B * L * V * D per device, V split 8 ways.
  assert flops['auto'] < flops['manual'] + one_hot_forward / 2, flops
