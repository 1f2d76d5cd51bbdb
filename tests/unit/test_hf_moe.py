"""Mixture-of-experts Hugging Face checkpoints (Mixtral, Qwen3-MoE): per-expert tensors read
into expert-sharded parameters and written back, the architecture a run exports as, a trained
run exported and read back, and what the engine refuses. Their logits against the NumPy
reference: tests/unit/test_hf_families.py (which these tests' checkpoints come from)."""

import json

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from engine import models
from engine.hf import load as hf
from engine.assemble import lay_out
from engine.workdir.checkpoint import restore_params
from engine.config import default_config
from engine.errors import ConfigError
from engine.export.exporter import export
from engine.main import run as run_main
from tests.unit.test_hf_families import (FAMILIES, MOE_NAMES, _checkpoint, _engine_config,
                                         _experts, assert_export_writes_back,
                                         reference_logits)


def _split_experts(abstract):
  """The abstract parameters with every expert-stacked one split over a (layers 2, experts 4)
  mesh of 8 devices: each device reads one layer's one expert (the router: its experts' rows)."""
  mesh = jax.make_mesh((2, 4), ('l', 'e'), devices=jax.devices()[:8])
  specs = {'w_router_DE': P('l', None, 'e'), 'w_gate_EDF': P('l', 'e'), 'w_up_EDF': P('l', 'e'),
           'w_down_EFD': P('l', 'e')}

  def split(keys, leaf):
    spec = specs.get(str(getattr(keys[-1], 'key', keys[-1])))
    return leaf if spec is None else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                          sharding=NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(split, abstract)


@pytest.mark.slow
@pytest.mark.parametrize('family', sorted(MOE_NAMES))
def test_experts_load_sharded_by_expert_and_export_back(tmp_path, family):
  hf_config = FAMILIES[family]
  tensors = _checkpoint(tmp_path / 'hf', hf_config, seed=5)
  config = _engine_config(tmp_path / 'hf')
  config = hf.with_model_config(config)
  model = config.model
  expert_dim = hf_config.get('moe_intermediate_size', hf_config['intermediate_size'])
  assert (model.num_experts, model.experts_per_token, model.moe_mlp_dim, model.moe_router,
          model.moe_dispatch, model.qk_norm) == (4, 2, expert_dim, 'softmax_topk', 'dropless',
                                                 family == 'qwen3_moe')
  setup = lay_out(config, 256, jax.devices()[:1])
  params = hf.load_params(str(tmp_path / 'hf'), _split_experts(setup.abstract_state()['params']))
  flat = hf.by_path(params)
  shard = flat['blocks/moe/w_gate_EDF'].addressable_shards[0]
  assert shard.data.shape == (1, 1, 64, expert_dim)  # One layer's one expert per device.
  host = {path: np.asarray(v) for path, v in flat.items()}
  block, gate, up, down = MOE_NAMES[family]
  for i in range(2):
    p = f'model.layers.{i}.{block}.'
    np.testing.assert_array_equal(host['blocks/moe/w_router_DE'][i], tensors[p + 'gate.weight'].T)
    for e in range(4):
      for path, name in (('w_gate_EDF', gate), ('w_up_EDF', up), ('w_down_EFD', down)):
        np.testing.assert_array_equal(host['blocks/moe/' + path][i, e],
                                      tensors[p + f'experts.{e}.{name}.weight'].T, err_msg=path)
  out = assert_export_writes_back(host, model, tensors, hf_config, tmp_path / 'out')
  assert out['architectures'] == hf_config['architectures'] and _experts(out) == 4
  if family == 'qwen3_moe':
    assert (out['norm_topk_prob'], out['moe_intermediate_size'], out['intermediate_size'],
            out['decoder_sparse_step'], out['mlp_only_layers']) == (True, 32, 128, 1, [])


def test_a_run_exports_as_the_architecture_that_computes_it():
  model = default_config().model
  model.name, model.num_experts = 'llama', 4
  assert models.hf_format_for(model).architecture == 'MixtralForCausalLM'
  model.qk_norm = True
  assert models.hf_format_for(model).architecture == 'Qwen3MoeForCausalLM'
  model.num_experts = 0
  assert models.hf_format_for(model).architecture == 'LlamaForCausalLM'
  model.num_experts, model.qk_norm, model.moe_shared_expert = 4, False, 16
  fmt = models.hf_format_for(model)
  assert models.unwritable(fmt, model) == ('model.moe_shared_expert=16 (MixtralForCausalLM has no '
                                           'shared expert)')
  model.moe_shared_expert, model.qkv_bias = 0, True
  assert 'q/k/v biases' in models.unwritable(models.hf_format_for(model), model)
  model.qkv_bias, model.moe_balance = False, 'aux_free'
  assert 'no router bias' in models.unwritable(models.hf_format_for(model), model)


@pytest.mark.slow
def test_a_run_from_mixtral_trains_and_exports_what_it_trained(tmp_path):
  _checkpoint(tmp_path / 'hf', FAMILIES['mixtral'])
  workdir = tmp_path / 'run'
  argv = ['--config=experiments/tiny.py', f'--workdir={workdir}', '--config.mesh.data=2',
          '--config.mesh.fsdp=2', '--config.mesh.tensor=2', '--config.train.num_steps=1',
          '--config.data.source=synthetic', f'--config.train.init_from=hf:{tmp_path / "hf"}',
          '--config.data.seq_len=16', '--config.parallelism.mode=manual']
  assert run_main(argv) == 0
  names = export(str(workdir), str(tmp_path / 'out'))
  assert 'model.layers.1.block_sparse_moe.experts.3.w2.weight' in names
  out = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert (out['architectures'], out['num_local_experts']) == (['MixtralForCausalLM'], 4)
  # Read back: the trained parameters, exactly.
  config = _engine_config(tmp_path / 'out', (8, 1, 1))
  config = hf.with_model_config(config)
  params = hf.load_params(str(tmp_path / 'out'), lay_out(config, 256).abstract_state()['params'])
  saved = ml_collections.ConfigDict(json.loads((workdir / 'config.json').read_text()))
  saved.mesh.data, saved.mesh.fsdp, saved.mesh.tensor = 8, 1, 1
  trained = restore_params(str(workdir), lay_out(saved, 256).abstract_state()['params'])
  loaded = hf.by_path(params)
  for path, value in hf.by_path(trained).items():
    np.testing.assert_array_equal(np.asarray(loaded[path]), np.asarray(value), err_msg=path)


def test_the_reference_sees_which_expert_is_which(tmp_path):
  """Experts 0 and 1 of layer 0 swapped: the reference's logits move far beyond the family
  tests' tolerance (2e-4), so a mixed-up expert or routing would fail them."""
  tokens = np.random.default_rng(1).integers(0, 256, (2, 16))
  for family, (block, *_) in MOE_NAMES.items():
    tensors = _checkpoint(tmp_path / family, FAMILIES[family])
    p = f'model.layers.0.{block}.experts.'
    swapped = dict(tensors, **{p + '0' + n[len(p) + 1:]: v for n, v in tensors.items()
                               if n.startswith(p + '1.')},
                   **{p + '1' + n[len(p) + 1:]: v for n, v in tensors.items()
                      if n.startswith(p + '0.')})
    gap = np.abs(reference_logits(tensors, FAMILIES[family], tokens) -
                 reference_logits(swapped, FAMILIES[family], tokens)).max()
    assert gap > 100 * 2e-4, (family, gap)


@pytest.mark.parametrize('family, change, message', [
    ('mixtral', {'router_jitter_noise': 0.01}, 'router_jitter_noise=0.01 is not supported'),
    ('qwen3_moe', {'norm_topk_prob': False}, 'norm_topk_prob=False is not supported'),
    ('qwen3_moe', {'decoder_sparse_step': 2}, r'decoder_sparse_step=2, mlp_only_layers=\[\], '
     'num_experts=4 make some layers dense'),
    ('qwen3_moe', {'mlp_only_layers': [1]}, r'mlp_only_layers=\[1\]'),
])
def test_what_the_engine_does_not_compute_is_refused(family, change, message):
  with pytest.raises(ConfigError, match=message):
    hf.model_config(dict(FAMILIES[family], **change), 'hf:x')
  hf.model_config(FAMILIES[family], 'hf:x')  # The unchanged config loads.
