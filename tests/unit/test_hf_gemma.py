"""Gemma 2 and Gemma 3 (text) checkpoints against a NumPy forward pass written from transformers'
modeling_gemma2 / modeling_gemma3: (1 + w) RMSNorms, a norm after each sublayer, GeGLU, the
embedding times sqrt(hidden), query_pre_attn_scalar, the attention and final logit soft caps
(Gemma 2), q / k norms and a rotary base by layer type (Gemma 3), on checkpoints the test writes
itself; sharded in both modes, ring attention, pipeline stages, generation, and export.
`python -m engine.analysis.hf_check --families=gemma2,gemma3` compares against transformers
itself, in another environment."""

import json
import math

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.assemble import assemble
from engine.errors import ConfigError
from engine.generate.sampling import Generator
from engine.hf import load as hf
from engine.parallel.decode import build_decode_steps
from engine.models.llama import config as llama_config
from engine.models.config_keys import ModelConfigError
from tests.unit.test_hf_families import (SEQ, _tokens, assert_export_writes_back, assert_logits,
                                         legacy, load_on_one_device)
from tests.unit.test_hf_families import _engine_config as _config
from tests.support.helpers import tiny_config

BASE = {'hidden_size': 64, 'intermediate_size': 128, 'num_attention_heads': 4,
        'num_key_value_heads': 2, 'head_dim': 16, 'vocab_size': 256, 'rms_norm_eps': 1e-6,
        'max_position_embeddings': 64, 'hidden_activation': 'gelu_pytorch_tanh',
        'tie_word_embeddings': True, 'attention_bias': False, 'sliding_window': 6}
# The local layers' window, 6, is shorter than the 16 positions, so the windows count.
FAMILIES = {
    # Every other layer global; caps small enough to bite at these logits' sizes; the attention
    # scale from query_pre_attn_scalar 24, not head_dim 16.
    'gemma2': dict(BASE, architectures=['Gemma2ForCausalLM'], model_type='gemma2',
                   num_hidden_layers=2, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0,
                   layer_types=['sliding_attention', 'full_attention'],
                   rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0}),
    # Every third layer global (4 layers: local, local, global, local), each type rotating with
    # its own base, the global layers' scaled linearly (as Gemma 3 4B and up).
    'gemma3': dict(BASE, architectures=['Gemma3ForCausalLM'], model_type='gemma3_text',
                   num_hidden_layers=4, query_pre_attn_scalar=16,
                   layer_types=['sliding_attention', 'sliding_attention', 'full_attention',
                                'sliding_attention'],
                   rope_parameters={
                       'full_attention': {'rope_type': 'linear', 'factor': 8.0,
                                          'rope_theta': 1e6},
                       'sliding_attention': {'rope_type': 'default', 'rope_theta': 10.0}}),
}


def legacy_gemma(config: dict) -> dict:
  """The config as transformers 4 wrote it: rope_theta, rope_scaling and Gemma 3's
  rope_local_base_freq on top, no layer_types (the pattern: sliding_window_pattern)."""
  config = dict(config)
  rope = config.pop('rope_parameters')
  types = config.pop('layer_types')
  config['sliding_window_pattern'] = types.index('full_attention') + 1
  if 'full_attention' not in rope:
    return legacy(dict(config, rope_parameters=rope))
  full = dict(rope['full_attention'])
  config.update(rope_theta=full.pop('rope_theta'),
                rope_local_base_freq=rope['sliding_attention']['rope_theta'],
                rope_scaling=full if full['rope_type'] != 'default' else None)
  return config


def checkpoint(directory, config: dict, seed=0) -> dict:
  """Random weights in Gemma's layout: every norm's w away from zero (Gemma multiplies by
  1 + w), no lm_head (tied)."""
  rng = np.random.default_rng(seed)
  D, F, K = config['hidden_size'], config['intermediate_size'], config['head_dim']
  H, N, V = config['num_attention_heads'], config['num_key_value_heads'], config['vocab_size']
  w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
  tensors = {'model.embed_tokens.weight': w(V, D), 'model.norm.weight': w(D)}
  for i in range(config['num_hidden_layers']):
    p = f'model.layers.{i}.'
    tensors.update({
        p + 'input_layernorm.weight': w(D), p + 'post_attention_layernorm.weight': w(D),
        p + 'pre_feedforward_layernorm.weight': w(D),
        p + 'post_feedforward_layernorm.weight': w(D),
        p + 'self_attn.q_proj.weight': w(H * K, D), p + 'self_attn.k_proj.weight': w(N * K, D),
        p + 'self_attn.v_proj.weight': w(N * K, D), p + 'self_attn.o_proj.weight': w(D, H * K),
        p + 'mlp.gate_proj.weight': w(F, D), p + 'mlp.up_proj.weight': w(F, D),
        p + 'mlp.down_proj.weight': w(D, F)})
    if config['model_type'] == 'gemma3_text':
      tensors.update({p + 'self_attn.q_norm.weight': w(K), p + 'self_attn.k_norm.weight': w(K)})
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / 'model.safetensors'))
  (directory / 'config.json').write_text(json.dumps(config))
  return tensors


def _rope(config: dict, layer_type: str, K: int) -> np.ndarray:
  """A layer type's inverse frequencies (modeling_rope_utils: default, linear)."""
  rope = config['rope_parameters']
  rope = rope.get(layer_type, rope)
  inv = 1.0 / rope['rope_theta'] ** (np.arange(0, K, 2) / K)
  return inv / rope['factor'] if rope['rope_type'] == 'linear' else inv


def reference_logits(t: dict, config: dict, tokens: np.ndarray,
                     embed_scale: bool = True) -> np.ndarray:
  """Gemma2ForCausalLM / Gemma3ForCausalLM's forward in NumPy (float64); `embed_scale` False
  leaves the embedding unscaled (to show that the scale counts)."""
  D, H, N = config['hidden_size'], config['num_attention_heads'], config['num_key_value_heads']
  K, eps = config['head_dim'], config['rms_norm_eps']
  B, L = tokens.shape
  g = lambda name: t[name].astype(np.float64)
  norm = lambda x, name: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 + g(name))
  cap = lambda x, c: c * np.tanh(x / c) if c else x
  gelu = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
  x = g('model.embed_tokens.weight')[tokens] * (np.float32(D ** 0.5) if embed_scale else 1)
  causal = np.tril(np.ones((L, L), bool))
  near = np.arange(L)[:, None] - np.arange(L) < config['sliding_window']
  for i, layer_type in enumerate(config['layer_types']):
    p = f'model.layers.{i}.'
    mask = causal & near if layer_type == 'sliding_attention' else causal
    angles = np.concatenate([np.arange(L)[:, None] * _rope(config, layer_type, K)] * 2, -1)
    rot = lambda x: x * np.cos(angles) + np.concatenate([-x[..., K // 2:], x[..., :K // 2]],
                                                        -1) * np.sin(angles)
    h = norm(x, p + 'input_layernorm.weight')
    heads = {}
    for name, n in (('q', H), ('k', N), ('v', N)):
      y = (h @ g(p + f'self_attn.{name}_proj.weight').T).reshape(B, L, n, K)
      if name != 'v' and p + f'self_attn.{name}_norm.weight' in t:
        y = norm(y, p + f'self_attn.{name}_norm.weight')
      heads[name] = y.transpose(0, 2, 1, 3)
    q, k = rot(heads['q']), rot(heads['k'])
    k, v = np.repeat(k, H // N, axis=1), np.repeat(heads['v'], H // N, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * config['query_pre_attn_scalar'] ** -0.5
    scores = np.where(mask, cap(scores, config.get('attn_logit_softcapping')), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, H * K)
    x = x + norm(out @ g(p + 'self_attn.o_proj.weight').T, p + 'post_attention_layernorm.weight')
    h = norm(x, p + 'pre_feedforward_layernorm.weight')
    y = (gelu(h @ g(p + 'mlp.gate_proj.weight').T) * (h @ g(p + 'mlp.up_proj.weight').T)
         @ g(p + 'mlp.down_proj.weight').T)
    x = x + norm(y, p + 'post_feedforward_layernorm.weight')
  logits = norm(x, 'model.norm.weight') @ g('model.embed_tokens.weight').T
  return cap(logits, config.get('final_logit_softcapping'))


def _mean_loss(logits, tokens):
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, tokens[:, 1:, None], -1).mean()


@pytest.fixture(scope='module')
def gemmas(tmp_path_factory):
  """Each family's checkpoint, (directory, config.json, tensors), by (family, window): its
  local layers' window 6 (shorter than the sequence) or 4096."""
  made = {}
  for family, config in FAMILIES.items():
    for window in (6, 4096):
      directory = tmp_path_factory.mktemp(f'{family}_{window}')
      config = dict(FAMILIES[family], sliding_window=window)
      made[family, window] = (directory, config, checkpoint(directory, config, seed=3))
  return made


@pytest.mark.parametrize('fmt', ['v5', 'legacy'])
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_family_loads_with_the_reference_logits(tmp_path, family, fmt):
  hf_config = FAMILIES[family] if fmt == 'v5' else legacy_gemma(FAMILIES[family])
  tensors = checkpoint(tmp_path / 'hf', hf_config)
  config = hf.with_model_config(_config(tmp_path / 'hf'))
  model = config.model
  assert (model.hf_architecture, model.post_norms, model.mlp_activation, model.embed_scale) == (
      FAMILIES[family]['architectures'][0], True, 'gelu_tanh', True)
  assert model.global_every == (2 if family == 'gemma2' else 3)
  assert_logits(config, tmp_path / 'hf', reference_logits(tensors, FAMILIES[family],
                                                          _tokens()[:, :-1]))


@pytest.mark.parametrize('change', ['norms', 'embed_scale', 'attention_cap', 'logit_cap',
                                    'local_rope', 'scalar', 'window'])
def test_the_reference_sees_each_option(tmp_path, change):
  """Each of Gemma's options moves the reference's logits far beyond the tolerance above, so
  the tests above fail without it."""
  family = 'gemma3' if change == 'local_rope' else 'gemma2'
  config = FAMILIES[family]
  tensors = checkpoint(tmp_path, config)
  tokens = _tokens()[:2, :-1]
  changed, other, embed_scale = dict(config), dict(tensors), change != 'embed_scale'
  if change == 'norms':  # A norm multiplying by w, not 1 + w.
    other = {k: v - 1 if k.endswith('norm.weight') else v for k, v in tensors.items()}
  elif change == 'attention_cap':
    changed['attn_logit_softcapping'] = None
  elif change == 'logit_cap':
    changed['final_logit_softcapping'] = None
  elif change == 'local_rope':
    changed['rope_parameters'] = dict(config['rope_parameters'], sliding_attention=dict(
        config['rope_parameters']['full_attention']))
  elif change == 'scalar':
    changed['query_pre_attn_scalar'] = config['head_dim']
  elif change == 'window':
    changed['sliding_window'] = 4096
  gap = np.abs(reference_logits(tensors, config, tokens) -
               reference_logits(other, changed, tokens, embed_scale)).max()
  assert gap > 100 * 2e-4, (change, gap)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_sharded_in_both_modes_the_loss_is_the_references(gemmas, mode):
  """2x2x2 (data, FSDP, tensor), then the sequence split 4 ways and two pipeline stages (each
  layer's rotary and window chosen by its number in the whole stack). Manual mode's ring
  attention computes no window: its checkpoints' window is longer than the sequence."""
  tokens = _tokens()
  for family in FAMILIES:
    for mesh, context, stage in (((2, 2, 2), 1, 1), ((2, 1, 1), 4, 1), ((2, 2, 1), 1, 2)):
      ring = mode == 'manual' and context > 1
      directory, hf_config, tensors = gemmas[family, 4096 if ring else 6]
      expected = _mean_loss(reference_logits(tensors, hf_config, tokens[:, :-1]), tokens)
      config = _config(directory, mesh=mesh)
      config.parallelism.mode, config.mesh.context, config.mesh.stage = mode, context, stage
      config.train.microbatches = 2 if stage > 1 else 1
      run = assemble(config)
      params = hf.load_params(str(directory), run.setup.abstract_state()['params'])
      loss = float(run.steps.eval(params, jax.device_put(tokens, run.setup.batch_sharding())))
      assert abs(loss - expected) < 1e-5 * max(1.0, expected), (family, mesh, context, stage,
                                                                 loss, expected)


@pytest.mark.slow
def test_generation_logits_are_the_references(gemmas):
  """The generation cache (its soft cap, each layer's rotary and window): the prefill's and then
  each decode step's logits, fed the sequence's tokens one by one, are the reference's at those
  positions."""
  sequence = _tokens()[:2, :SEQ]
  prompt = 5
  for family in FAMILIES:
    directory, hf_config, tensors = gemmas[family, 6]
    config = hf.with_model_config(_config(directory))
    setup, params = load_on_one_device(config, directory)
    expected = reference_logits(tensors, hf_config, sequence)
    generator = Generator(setup, prompt, SEQ - prompt)
    steps = build_decode_steps(setup, generator._empty_cache, lambda logits_BV, key: logits_BV)
    key = jax.random.key(0)
    cache, logits = steps.prefill(params, sequence[:, :prompt], np.full(2, prompt, np.int32), key)
    got = [np.asarray(logits)]
    for position in range(prompt, SEQ - 1):
      cache, logits = steps.decode(params, cache, sequence[:, position],
                                   np.full(2, position, np.int32), key)
      got.append(np.asarray(logits))
    np.testing.assert_allclose(np.stack(got, 1), expected[:, prompt - 1:SEQ - 1], atol=2e-4,
                               rtol=1e-4, err_msg=family)


def test_export_writes_the_checkpoint_back(gemmas, tmp_path):
  """Every tensor as read (the norms' w, not 1 + w; the head as lm_head, untied), and a
  config.json that reads back as the same model."""
  for family in FAMILIES:
    directory, hf_config, tensors = gemmas[family, 6]
    config = hf.with_model_config(_config(directory))
    setup, params = load_on_one_device(config, directory)
    flat = {'/'.join(map(str, k)): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
            for k in [[getattr(p, 'key', p) for p in k]]}
    expected = dict(tensors, **{'lm_head.weight': tensors['model.embed_tokens.weight']})
    written = assert_export_writes_back(flat, config.model, _rounded(expected), hf_config,
                                        tmp_path / family)
    assert written['tie_word_embeddings'] is False
    assert written['layer_types'] == hf_config['layer_types']


def _rounded(tensors: dict) -> dict:
  """The norms as the export computes them: (1 + w) - 1 in float32 (w to within its rounding)."""
  return {k: (np.float32(1) + v) - np.float32(1) if k.endswith('norm.weight') else v
          for k, v in tensors.items()}


@pytest.mark.parametrize('change, message', [
    ({'hidden_activation': 'gelu'}, "hidden_activation='gelu' is not supported"),
    ({'layer_types': ['full_attention', 'sliding_attention']},
     'is not every n-th layer global'),
    ({'use_bidirectional_attention': True}, 'use_bidirectional_attention=true'),
])
def test_what_the_engine_does_not_compute_is_refused(change, message):
  with pytest.raises(ConfigError, match=message):
    hf.model_config(dict(FAMILIES['gemma2'], **change), 'hf:x')


def test_softcap_with_dot_product_attention_is_refused(tmp_path):
  checkpoint(tmp_path, dict(FAMILIES['gemma2'], sliding_window=4096))
  config = hf.with_model_config(_config(tmp_path, mesh=(8, 1, 1)))
  config.model.attention = 'dot_product_attention'
  with pytest.raises(ConfigError, match="model.attention_softcap=2.0 with model.attention="
                     "'dot_product_attention': only the einsum attention caps the logits"):
    assemble(config)


@pytest.mark.parametrize('change, message', [
    ({'rope_local_base': 100.0}, 'model.rope_local_base=100.0 needs model.global_every > 0'),
    ({'global_every': 2, 'num_experts': 4}, 'model.global_every=2 with model.num_experts'),
    ({'mlp_activation': 'relu'}, "model.mlp_activation='relu' is unknown"),
    ({'logit_softcap': -1.0}, 'model.logit_softcap=-1.0 must be >= 0'),
])
def test_bad_gemma_options_are_refused(change, message):
  config = tiny_config(mesh=(8, 1, 1))
  config.model.name = 'llama'
  config.model.update(change)
  with pytest.raises(ConfigError, match=message):
    assemble(config)


@pytest.mark.parametrize('change, message', [
    ({'model.attention': 'dot_product_attention'}, "and model.attention='dot_product_attention' "
     "computes full causal attention"),
    ({'mesh.context': 2, 'parallelism.mode': 'manual'}, r'and mesh.context=2 in manual mode \(ring '
     r'attention\) computes full causal attention'),
])
def test_a_window_the_attention_cannot_compute_is_refused(tmp_path, change, message):
  checkpoint(tmp_path, dict(FAMILIES['gemma3']))
  config = hf.with_model_config(_config(tmp_path, mesh=(8, 1, 1)))
  for key, value in change.items():
    section, name = key.split('.')
    config[section][name] = value
  if 'mesh.context' in change:
    config.mesh.data = 4
  with pytest.raises(ConfigError, match='model.sliding_window=6 is shorter than data.seq_len=16, '
                     + message):
    assemble(config)


def test_the_kernel_does_not_cap_the_logits(tmp_path):
  checkpoint(tmp_path, FAMILIES['gemma2'])
  model = hf.with_model_config(_config(tmp_path)).model
  model.attention = 'splash'
  with pytest.raises(ModelConfigError, match="model.attention_softcap=2.0 with model.attention="
                     "'splash'"):
    llama_config.check(model, {})


def test_a_llama_with_gemma_options_is_not_exported_as_llama(tmp_path):
  from engine import models
  checkpoint(tmp_path, FAMILIES['gemma3'])
  config = hf.with_model_config(_config(tmp_path))
  config.model.hf_architecture = ''
  assert models.hf_format_for(config.model).architecture == 'Gemma3ForCausalLM'
  assert 'computes none of Gemma' in models.unwritable(models.HF_FORMATS['LlamaForCausalLM'],
                                                       config.model)
  assert 'model.qk_norm=True' in models.unwritable(models.HF_FORMATS['Gemma2ForCausalLM'],
                                                   config.model)
