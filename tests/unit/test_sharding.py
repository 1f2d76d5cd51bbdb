"""Mesh construction, rule presets -> PartitionSpecs, and sharded initialisation."""

import io
import contextlib

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

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


def test_sharded_init_equals_unsharded_init():
  setup8 = _setup(tiny_config(mesh=(2, 2, 2)))
  setup1 = _setup(tiny_config(mesh=(8, 1, 1)))
  sharded, _ = setup8.init(seed=3)
  replicated, _ = setup1.init(seed=3)
  for a, b in zip(jax.tree.leaves(sharded['params']), jax.tree.leaves(replicated['params'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_visualize_draws_every_device():
  train_setup = _setup(tiny_config(mesh=(2, 2, 2)))
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    spec = train_setup.rules.spec(('layers', None, 'embed', 'heads', 'head_dim'))
    layout.visualize((2, 3, 32, 4, 8), jax.sharding.NamedSharding(train_setup.mesh, spec))
  for device in range(8):
    assert f'{device}' in out.getvalue()
