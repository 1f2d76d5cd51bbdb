"""Hugging Face Llama checkpoints in and out (engine/hf/load.py, engine/export/exporter.py), against a NumPy
Llama written from Hugging Face's modeling code, on a checkpoint the test writes itself."""

import json

import jax
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from engine import parallel
from engine.hf import load as hf
from engine.hf import save as hf_save
from engine.workdir.checkpoint import restore_params
from engine.export.exporter import export
from engine.main import run as run_main
from engine.assemble import lay_out
from tests.support.helpers import tiny_config

HF_CONFIG = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 64,
    'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4,
    'num_key_value_heads': 2, 'vocab_size': 256, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-5,
    'max_position_embeddings': 64, 'hidden_act': 'silu', 'tie_word_embeddings': False,
}
SEQ = 16


def _random_checkpoint(directory, tied=False):
  """A randomly initialised Llama in Hugging Face's layout: [out, in] weights, one tensor per
  layer, bfloat16 as published checkpoints are."""
  rng = np.random.default_rng(0)
  c = dict(HF_CONFIG, tie_word_embeddings=tied)
  D, F, H, N = c['hidden_size'], c['intermediate_size'], c['num_attention_heads'], 2
  K, V = D // H, c['vocab_size']
  w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype('bfloat16')
  tensors = {'model.embed_tokens.weight': w(V, D), 'model.norm.weight': 1 + w(D)}
  if not tied:
    tensors['lm_head.weight'] = w(V, D)
  for i in range(c['num_hidden_layers']):
    p = f'model.layers.{i}.'
    tensors.update({
        p + 'input_layernorm.weight': 1 + w(D), p + 'post_attention_layernorm.weight': 1 + w(D),
        p + 'self_attn.q_proj.weight': w(H * K, D), p + 'self_attn.k_proj.weight': w(N * K, D),
        p + 'self_attn.v_proj.weight': w(N * K, D), p + 'self_attn.o_proj.weight': w(D, H * K),
        p + 'mlp.gate_proj.weight': w(F, D), p + 'mlp.up_proj.weight': w(F, D),
        p + 'mlp.down_proj.weight': w(D, F)})
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / 'model.safetensors'))
  (directory / 'config.json').write_text(json.dumps(c))
  return {k: v.astype(np.float32) for k, v in tensors.items()}, c


def _reference_logits(t, c, tokens):
  """Hugging Face's LlamaForCausalLM forward in NumPy (float64): RMSNorm, rotate-half rotary,
  grouped-query causal attention, SwiGLU."""
  D, H, N = c['hidden_size'], c['num_attention_heads'], c['num_key_value_heads']
  K, eps = D // H, c['rms_norm_eps']
  B, L = tokens.shape
  norm = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
  inv = 1.0 / c['rope_theta'] ** (np.arange(0, K, 2) / K)
  angles = np.concatenate([np.arange(L)[:, None] * inv] * 2, -1)  # [L, K]
  rot = lambda x: x * np.cos(angles) + np.concatenate([-x[..., K // 2:], x[..., :K // 2]],
                                                      -1) * np.sin(angles)
  x = t['model.embed_tokens.weight'].astype(np.float64)[tokens]
  mask = np.tril(np.ones((L, L), bool))
  for i in range(c['num_hidden_layers']):
    g = lambda name: t[f'model.layers.{i}.{name}'].astype(np.float64)
    h = norm(x, g('input_layernorm.weight'))
    q = (h @ g('self_attn.q_proj.weight').T).reshape(B, L, H, K).transpose(0, 2, 1, 3)
    k = (h @ g('self_attn.k_proj.weight').T).reshape(B, L, N, K).transpose(0, 2, 1, 3)
    v = (h @ g('self_attn.v_proj.weight').T).reshape(B, L, N, K).transpose(0, 2, 1, 3)
    q, k = rot(q), rot(k)
    k, v = np.repeat(k, H // N, axis=1), np.repeat(v, H // N, axis=1)
    scores = np.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(K), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, H * K)
    x = x + out @ g('self_attn.o_proj.weight').T
    h = norm(x, g('post_attention_layernorm.weight'))
    gate, up = h @ g('mlp.gate_proj.weight').T, h @ g('mlp.up_proj.weight').T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ g('mlp.down_proj.weight').T
  head = t.get('lm_head.weight', t['model.embed_tokens.weight']).astype(np.float64)
  return norm(x, t['model.norm.weight']) @ head.T


def _config(path, mesh=(1, 1, 1)):
  config = tiny_config(mesh=mesh)
  config.train.init_from = f'hf:{path}'
  config.model.max_len = config.data.seq_len = SEQ
  return hf.with_model_config(config)


def _tokens():
  return np.random.default_rng(1).integers(0, 256, (8, SEQ + 1)).astype(np.int32)


@pytest.mark.parametrize('tied', [False, True])
def test_loads_with_the_reference_logits_and_exports_back(tmp_path, tied):
  tensors, c = _random_checkpoint(tmp_path / 'hf', tied)
  config = _config(tmp_path / 'hf')
  assert (config.model.name, config.model.embed_dim, config.model.num_kv_heads) == ('llama', 64, 2)
  # The single-device engine model, loaded from the files, against the NumPy reference.
  setup1 = lay_out(config, 256, jax.devices()[:1])
  params = hf.load_params(str(tmp_path / 'hf'), setup1.abstract_state()['params'])
  tokens = _tokens()[:, :-1]
  logits = nnx.merge(setup1.graphdef, params)(tokens)
  np.testing.assert_allclose(logits, _reference_logits(tensors, c, tokens), atol=2e-4, rtol=0)
  # Export -> import is the identity: every Hugging Face tensor written back exactly (a tied
  # head is written out as its own tensor).
  host = {path: np.asarray(v) for path, v in hf.by_path(params).items()}
  hf_save.save(host, config.model, 256, str(tmp_path / 'out'))
  with safe_open(str(tmp_path / 'out' / 'model.safetensors'), framework='numpy') as f:
    written = {name: f.get_tensor(name) for name in f.keys()}
  expected = dict(tensors, **({'lm_head.weight': tensors['model.embed_tokens.weight']}
                              if tied else {}))
  assert written.keys() == expected.keys()
  for name, value in expected.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  assert hf.model_config(json.loads((tmp_path / 'out' / 'config.json').read_text()), 'out') == (
      hf.model_config(c, 'in'))


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_loaded_sharded_on_2x2x2_in_both_modes(tmp_path, mode):
  tensors, c = _random_checkpoint(tmp_path / 'hf')
  config = _config(tmp_path / 'hf', (2, 2, 2))
  train_setup = lay_out(config, 256)
  abstract = train_setup.abstract_state()['params']
  params = hf.load_params(str(tmp_path / 'hf'), abstract)
  # Nothing materialised whole: every device holds exactly its shard of each parameter.
  for leaf, target in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
    assert leaf.sharding == target.sharding
    for shard in leaf.addressable_shards:
      assert shard.data.shape == target.sharding.shard_shape(target.shape)
  whole = [jax.tree_util.keystr(path) for path, leaf in jax.tree_util.tree_leaves_with_path(params)
           if leaf.addressable_shards[0].data.size == leaf.size]
  assert all('norm' in path for path in whole), whole  # Only the norms' scales are replicated.
  # The loss of each mode's step on these parameters is the reference model's loss.
  tokens = _tokens()
  reference = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      _reference_logits(tensors, c, tokens[:, :-1]), tokens[:, 1:])).mean()
  steps = parallel.build_steps(mode, train_setup)
  batch = jax.device_put(tokens, train_setup.batch_sharding())
  assert float(steps.eval(params, batch)) == pytest.approx(reference, abs=1e-4)


@pytest.mark.slow
def test_train_from_hf_then_export_cli(tmp_path):
  _random_checkpoint(tmp_path / 'hf')
  workdir = tmp_path / 'run'
  argv = ['--config=experiments/tiny.py', f'--workdir={workdir}', '--config.mesh.data=2',
          '--config.mesh.fsdp=2', '--config.mesh.tensor=2', '--config.train.num_steps=1',
          '--config.data.source=synthetic', f'--config.train.init_from=hf:{tmp_path / "hf"}',
          '--config.parallelism.mode=manual']
  assert run_main(argv) == 0
  saved = json.loads((workdir / 'config.json').read_text())
  assert (saved['model']['name'], saved['model']['num_layers']) == ('llama', 2)
  names = export(str(workdir), str(tmp_path / 'out'))
  assert 'model.layers.1.mlp.down_proj.weight' in names and 'lm_head.weight' in names
  # Exported, then imported: the trained parameters, exactly.
  config = _config(tmp_path / 'out', (8, 1, 1))
  params = hf.load_params(str(tmp_path / 'out'), lay_out(config, 256).abstract_state()['params'])
  config_run = ml_collections.ConfigDict(saved)
  config_run.mesh.data, config_run.mesh.fsdp, config_run.mesh.tensor = 8, 1, 1
  trained = restore_params(str(workdir), lay_out(config_run, 256).abstract_state()['params'])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(trained)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# What the engine refuses of a checkpoint: tests/unit/test_hf_families.py.
