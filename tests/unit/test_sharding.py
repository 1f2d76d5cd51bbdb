"""Mesh construction, rule presets -> PartitionSpecs, and sharded initialisation."""

import io
import contextlib

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from engine import config as config_lib
from engine import sharding
from engine.analysis.show_layout import layout
from engine.mesh import make_mesh
from engine.assemble import assemble
from tests.support.helpers import tiny_config


def _setup(config):
  return assemble(config).setup


def test_make_mesh_named_axes_and_minus_one():
  config = tiny_config(mesh=(-1, 2, 2))
  mesh = make_mesh(config.mesh)
  assert mesh.axis_names == ('data', 'fsdp', 'tensor', 'context', 'stage', 'expert')
  assert dict(mesh.shape) == {'data': 2, 'fsdp': 2, 'tensor': 2, 'context': 1, 'stage': 1,
                              'expert': 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert mesh.devices.size == 8


# Expected specs of a few parameters under each preset on the full 2x2x2 mesh; the leading
# stacked `layers` dimension is never split.
_EXPECTED = {
    'data_parallel': {'tok_embed_VD': P(None, None), 'blocks/w_up_DF': P(None, None, None),
                      'blocks/w_out_HKD': P(None, None, None, None), 'batch': P('data', None)},
    'fsdp': {'tok_embed_VD': P(None, 'fsdp'), 'blocks/w_up_DF': P(None, 'fsdp', None),
             'blocks/w_out_HKD': P(None, None, None, 'fsdp'),
             'batch': P(('data', 'fsdp'), None)},
    'tensor': {'tok_embed_VD': P('tensor', None), 'blocks/w_up_DF': P(None, None, 'tensor'),
               'blocks/w_out_HKD': P(None, 'tensor', None, None), 'batch': P('data', None)},
    'fsdp_tensor': {'tok_embed_VD': P('tensor', 'fsdp'),
                    'blocks/w_up_DF': P(None, 'fsdp', 'tensor'),
                    'blocks/w_out_HKD': P(None, 'tensor', None, 'fsdp'),
                    'batch': P(('data', 'fsdp'), None)},
}


_MESH_FOR = {'data_parallel': (8, 1, 1), 'fsdp': (2, 4, 1), 'tensor': (2, 1, 4),
             'fsdp_tensor': (2, 2, 2)}


@pytest.mark.parametrize('preset', sorted(sharding.RULE_PRESETS))
def test_rules_to_specs_for_every_preset(preset):
  config = tiny_config(mesh=_MESH_FOR[preset])
  config.parallelism.rules = preset
  train_setup = _setup(config)
  specs = {p.path: p.spec for p in train_setup.parameters()}
  for name, expected in _EXPECTED[preset].items():
    if name == 'batch':
      assert train_setup.rules.spec(('batch', None), activation=True) == expected
    else:
      assert specs[name] == expected, name
  # Norm parameters are replicated under every preset.
  assert specs['ln_final/scale'] == P(None)


def test_auto_rules_follow_the_mesh_shape():
  rules = sharding.rules_for('auto', {'data': 8, 'fsdp': 1, 'tensor': 1})
  assert rules.spec(('vocab', 'embed')) == P(None, None)
  assert rules.spec(('batch', 'length'), activation=True) == P('data', None)
  rules = sharding.rules_for('auto', {'data': 1, 'fsdp': 2, 'tensor': 4})
  assert rules.spec(('vocab', 'embed')) == P('tensor', 'fsdp')
  assert rules.spec(('batch', 'length', 'embed'), activation=True) == P('fsdp', None, None)


def test_sharded_init_places_each_parameter_by_its_spec():
  train_setup = _setup(tiny_config(mesh=(2, 2, 2)))
  state, _ = train_setup.init(seed=0)
  specs = train_setup.state_specs()
  for array, spec in zip(jax.tree.leaves(state['params']),
                         jax.tree.leaves(specs['params'], is_leaf=lambda x: isinstance(x, P))):
    assert array.sharding.spec == spec
    assert array.addressable_shards[0].data.shape == array.sharding.shard_shape(array.shape)
  # Adam's moments live where their parameters live.
  mu = optax.tree.get(state['opt_state'], 'mu')
  assert mu['tok_embed_VD'].sharding.spec == P('tensor', 'fsdp')


def test_sharded_init_never_holds_the_whole_model_on_one_device():
  config = tiny_config(mesh=(1, 8, 1))
  config.model.embed_dim = 64
  config.model.mlp_dim = 256
  train_setup = _setup(config)
  state, compiled = train_setup.init(seed=0)
  total = sum(x.nbytes for x in jax.tree.leaves(state))
  per_device_output = compiled.memory_analysis().output_size_in_bytes
  per_device_peak = per_device_output + compiled.memory_analysis().temp_size_in_bytes
  # Only the norms (and the step counter) are replicated: the outputs are about 1/8 of the
  # state and the init's working set stays far below the whole state.
  assert per_device_output < total / 8 * 1.15, (per_device_output, total)
  assert per_device_peak < total / 2, (per_device_peak, total)
  assert sharding.bytes_per_device(state) == pytest.approx(per_device_output, rel=0.01)


def _layout(mesh, mode, **values):
  """tiny_config on mesh DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]] in `mode`, with `values`
  ({'model.name': 'llama', ...})."""
  config = tiny_config(mesh=mesh[:3])
  config.mesh.context, config.mesh.stage, config.mesh.expert = (*mesh[3:], 1, 1, 1)[:3]
  config.parallelism.mode = mode
  for key, value in values.items():
    section, name = key.split('.')
    config[section][name] = value
  return config


_DEEPSEEK = {'model.name': 'llama', 'model.tie_embeddings': False, 'model.num_experts': 4,
             'model.moe_mlp_dim': 16, 'model.moe_shared_expert': 16,
             'model.moe_router': 'sigmoid_topk', 'model.moe_balance': 'aux_free',
             'model.moe_aux_loss_coef': 0.0, 'model.mla_kv_rank': 16, 'model.mla_q_rank': 16,
             'model.mla_rope_dim': 4, 'model.head_dim': 8, 'model.mla_value_dim': 8}
# One of each kind of layout the parity tests run: what each splits, stacks or groups.
_INIT_LAYOUTS = {
    'data2_fsdp2_tensor2_auto': _layout((2, 2, 2), 'auto'),
    'fsdp2_tensor2_stage2_manual': _layout((1, 2, 2, 1, 2), 'manual',
                                           **{'train.microbatches': 2}),
    'circular_stage2_fsdp2_auto': _layout((2, 2, 1, 1, 2), 'auto', **{
        'model.num_layers': 4, 'train.pipeline_repeats': 2, 'train.microbatches': 2}),
    'deepseek_expert2_fsdp2_tensor2_manual': _layout((1, 2, 2, 1, 1, 2), 'manual', **_DEEPSEEK),
    'deepseek_data2_stage2_expert2_auto': _layout((2, 1, 1, 1, 2, 2), 'auto', **_DEEPSEEK,
                                                  **{'train.microbatches': 2}),
    'muon_data4_tensor2_manual': _layout((4, 1, 2), 'manual', **{'optim.name': 'muon'}),
    'zero1_data4_fsdp2_auto': _layout((4, 2, 1), 'auto', **{
        'parallelism.optimizer_sharding': 'zero1'}),
}


@pytest.mark.parametrize('name', list(_INIT_LAYOUTS))
def test_sharded_init_equals_unsharded_init(name):
  """The whole state a layout's sharded init creates (parameters, optimizer state), value for
  value, is the one-device init's: random initialisers give the same numbers however their
  outputs are split. tests/support/helpers.py relies on it: later layouts of a model in a test
  file get the first one's initial values placed in their shardings."""
  config = _INIT_LAYOUTS[name]
  one = config_lib.with_values(config, {
      'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 1, 'mesh.context': 1, 'mesh.stage': 1,
      'mesh.expert': 1, 'train.microbatches': 1, 'train.pipeline_repeats': 1})
  sharded, _ = _setup(config).init(seed=3)
  whole, _ = assemble(one, jax.devices()[:1]).setup.init(seed=3)
  sharded = dict(jax.tree_util.tree_leaves_with_path(sharded))
  whole = dict(jax.tree_util.tree_leaves_with_path(whole))
  assert sharded.keys() == whole.keys()
  for path, array in sharded.items():  # A circular pipeline's stack: [R, L / R, ...].
    np.testing.assert_array_equal(np.asarray(array), np.reshape(whole[path], array.shape),
                                  err_msg=jax.tree_util.keystr(path))


def test_visualize_draws_every_device():
  train_setup = _setup(tiny_config(mesh=(2, 2, 2)))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    spec = train_setup.rules.spec(('layers', None, 'embed', 'heads', 'head_dim'))
    layout.visualize((2, 3, 32, 4, 8), jax.sharding.NamedSharding(train_setup.mesh, spec))
  for device in range(8):
    assert f'{device}' in out.getvalue()
