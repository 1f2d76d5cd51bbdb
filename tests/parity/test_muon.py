"""optim.name=muon (engine/muon.py): Muon on the layers' matrices, AdamW on the rest.

- Which parameters Muon takes, and along which dimensions, for every kind of projection the
  built-in models have (attention, fused q / k / v, latent attention, experts).
- Both modes equal the single-device reference, which is optax's own `muon` on the same
  matrices (engine.analysis.reference), on data x fsdp x tensor (matrices split over fsdp and
  tensor), with pipeline stages, and on a mixture of experts split over expert; auto mode with
  ZeRO-1 too. Orthogonalizing each device's block instead of the whole matrix (the planted bug)
  fails that.
- Manual mode's step makes each split matrix's update and momentum whole, by all_to_all where
  its stack divides over the split and by all-gathers where not: the bytes it adds to AdamW's
  step, from the HLO. A stack that divides is exchanged, and equals one device too.
- A Muon run resumes exactly, manual mode's blocks in auto mode too. (Bad input:
  tests/support/bad_inputs_main.py.)
"""

import math

import numpy as np
import pytest
from optax.contrib import MuonDimensionNumbers as Dims

from engine import muon
from engine.assemble import lay_out
from engine.parallel import muon_blocks
from tests.parity.test_llama import llama_config
from tests.support.helpers import (assert_resumes_exactly, assert_same_run, collective_table,
                                   compiled_train_step, engine_run, single_device_run)


def test_muon_takes_the_projections_and_leaves_the_rest_to_adamw():
  cases = {
      ('layers', 'embed', 'mlp'): Dims((1,), (2,)),
      ('layers', 'mlp', 'embed'): Dims((1,), (2,)),
      ('layers', 'heads', 'head_dim', 'embed'): Dims((1, 2), (3,)),
      ('layers', 'embed', 'kv_heads', 'head_dim'): Dims((1,), (2, 3)),
      ('layers', 'qkv', 'embed', 'heads', 'head_dim'): Dims((2,), (3, 4)),
      ('layers', 'latent', 'heads', 'head_dim'): Dims((1,), (2, 3)),
      ('first_layers', 'embed', 'latent'): Dims((1,), (2,)),
      ('layers', 'experts', 'embed', 'mlp'): Dims((2,), (3,)),
      ('layers', 'experts', 'mlp', 'embed'): Dims((2,), (3,)),
      ('vocab', 'embed'): None, ('embed', 'vocab'): None, (None, 'embed'): None,
      ('layers', 'embed', None): None, ('layers', 'norm'): None, ('layers', 'embed'): None,
  }
  for axes, expected in cases.items():
    assert muon.dimension_numbers(axes) == expected, axes


def _config(mesh=(1, 1, 1), mode='auto', **model_keys):
  config = llama_config(mesh)
  config.optim.name, config.parallelism.mode = 'muon', mode
  config.optim.muon_learning_rate = 0.05
  config.model.update(model_keys)
  return config


@pytest.fixture(scope='module')
def reference():
  return single_device_run(_config(), 2)


def test_the_reference_is_not_adamw(reference):
  """The parity below compares Muon runs: an AdamW step moves the parameters elsewhere."""
  adamw = single_device_run(llama_config(), 2)
  differs = [np.abs(reference.params[k] - adamw.params[k]).max() for k in adamw.params]
  assert max(differs) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
@pytest.mark.parametrize('mesh', [(2, 2, 2, 1), (2, 1, 2, 2)], ids=['2x2x2', 'data2_tensor2_stage2'])
def test_both_modes_equal_optax_muon_on_one_device(mesh, mode, reference):
  """Two layers: manual mode gathers each split matrix (a stack of two does not divide over the
  fsdp x tensor devices)."""
  config = _config(mesh[:3], mode)
  config.mesh.stage = mesh[3]
  if mesh[3] > 1:
    config.train.microbatches = 2
  assert_same_run(engine_run(config, mode, 2), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_a_stack_that_divides_is_exchanged_and_equals_it_too(mode):
  """Four layers over fsdp 2 x tensor 2: manual mode hands each device whole matrices of one
  layer (all_to_all) instead of gathering."""
  config = _config((2, 2, 2), mode, num_layers=4)
  plans = muon_blocks.MatrixBlocks(lay_out(config, 256)).plans
  assert {plan.stack_dim for plan in plans.values()} == {0}
  assert_same_run(engine_run(config, mode, 2), single_device_run(_config(num_layers=4), 2))


@pytest.mark.slow
def test_auto_mode_with_zero1_equals_it_too(reference):
  config = _config((8, 1, 1), 'auto')
  config.parallelism.optimizer_sharding = 'zero1'
  assert_same_run(engine_run(config, 'auto', 2), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_experts_split_over_expert_are_separate_matrices(mode):
  config = _config((2, 1, 2), mode, num_experts=4, experts_per_token=2, moe_capacity_factor=0.0)
  config.mesh.expert = 2
  reference_config = _config(num_experts=4, experts_per_token=2, moe_capacity_factor=0.0)
  assert_same_run(engine_run(config, mode, 2), single_device_run(reference_config, 2))


@pytest.mark.slow
def test_blocks_orthogonalized_alone_are_caught(reference, monkeypatch):
  monkeypatch.setattr(muon_blocks.MatrixBlocks, 'whole', lambda self, tree: tree)
  monkeypatch.setattr(muon_blocks.MatrixBlocks, 'blocks', lambda self, tree: tree)
  with pytest.raises(AssertionError):
    assert_same_run(engine_run(_config((2, 2, 2), 'manual'), 'manual', 2), reference)


@pytest.mark.slow
@pytest.mark.parametrize('layers', [2, 4], ids=['gathered', 'exchanged'])
def test_manual_mode_moves_each_split_matrix_and_its_momentum_once(layers):
  """data 2 x fsdp 2 x tensor 2: the collectives Muon adds to AdamW's step (the HLO counts each
  all-gather's and all-to-all's result): gathered, the float32 blocks made whole one split
  dimension after another; exchanged, the block itself there and back, per split axis."""
  moved = {}
  for name in ('adamw', 'muon'):
    config = _config((2, 2, 2), 'manual', num_layers=layers)
    config.optim.name = name
    train_setup, compiled = compiled_train_step(config, 'manual')
    moved[name] = sum(row['bytes'] for (kind, _), row in
                      collective_table(train_setup, compiled).items()
                      if kind in ('all-gather', 'all-to-all'))
  mesh, expected = dict(train_setup.mesh.shape), 0
  for p in train_setup.parameters():
    dims = muon.dimension_numbers(p.logical_axes)
    if dims is None:
      continue
    plan = muon_blocks.matrix_plan(p.spec, dims, p.shard_shape, mesh)
    size = 4 * math.prod(p.shard_shape)
    for _, axes in plan.splits:
      if plan.stack_dim is None:
        size *= math.prod(mesh[a] for a in axes)
        expected += 2 * size  # The update and the momentum, gathered.
      else:
        expected += 4 * size  # Both, there and back.
  assert expected > 0
  assert moved['muon'] - moved['adamw'] == expected


@pytest.mark.slow
def test_a_muon_run_resumes_exactly(tmp_path):
  def config(steps, mode='manual'):
    c = _config((2, 2, 2), mode)
    c.train.num_steps, c.optim.decay_steps = steps, 8
    c.train.checkpoint_every, c.train.async_checkpoints = 2, False
    return c

  # Manual mode's blocks restored into auto mode: the same optimizer state in both.
  assert_resumes_exactly(config, tmp_path, {'mode': 'auto'})
