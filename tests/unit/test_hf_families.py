"""The Llama family's Hugging Face checkpoints (Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3) in
both config formats (transformers 5's `rope_parameters`, the older top-level `rope_theta` /
`rope_scaling`), against a NumPy forward pass written from transformers' modeling code
(modeling_llama / modeling_qwen2 / modeling_qwen3 and modeling_rope_utils), on checkpoints the
test writes itself. `python -m engine.analysis.hf_check` runs the same comparison against
transformers itself, in another environment."""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from engine.hf import load as hf
from engine.hf import save as hf_save
from engine.assemble import assemble, lay_out
from engine.errors import ConfigError
from engine.generate.sampling import Generator
from engine.parallel.auto import AutoOps
from tests.support.helpers import tiny_config

SEQ = 16
BASE = {'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'vocab_size': 256,
        'rms_norm_eps': 1e-5, 'max_position_embeddings': 64, 'hidden_act': 'silu',
        'tie_word_embeddings': False}
LLAMA3_ROPE = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 8}
FAMILIES = {
    'llama2': dict(BASE, architectures=['LlamaForCausalLM'], model_type='llama',
                   rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0}),
    'llama3': dict(BASE, architectures=['LlamaForCausalLM'], model_type='llama',
                   rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0)),
    'linear': dict(BASE, architectures=['LlamaForCausalLM'], model_type='llama',
                   rope_parameters={'rope_type': 'linear', 'factor': 4.0, 'rope_theta': 1e4}),
    'mistral': dict(BASE, architectures=['MistralForCausalLM'], model_type='mistral',
                    head_dim=8, sliding_window=4096,
                    rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}),
    'qwen2': dict(BASE, architectures=['Qwen2ForCausalLM'], model_type='qwen2',
                  use_sliding_window=False, sliding_window=4,
                  rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}),
    'qwen3': dict(BASE, architectures=['Qwen3ForCausalLM'], model_type='qwen3', head_dim=32,
                  rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}),
    # Mixtures of experts: 4 experts, 2 per token (Qwen3-MoE's experts narrower than its
    # unused dense intermediate_size; its older files name the count num_experts).
    'mixtral': dict(BASE, architectures=['MixtralForCausalLM'], model_type='mixtral',
                    num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
                    sliding_window=None, rope_parameters={'rope_type': 'default',
                                                          'rope_theta': 1e6}),
    'qwen3_moe': dict(BASE, architectures=['Qwen3MoeForCausalLM'], model_type='qwen3_moe',
                      head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      use_sliding_window=False, sliding_window=4096,
                      rope_parameters={'rope_type': 'default', 'rope_theta': 1e6}),
}
# Each mixture-of-experts architecture's names: (block, gate, up, down).
MOE_NAMES = {'mixtral': ('block_sparse_moe', 'w1', 'w3', 'w2'),
             'qwen3_moe': ('mlp', 'gate_proj', 'up_proj', 'down_proj')}


def legacy(config: dict) -> dict:
  """The same config in the format transformers 4 wrote: rope_theta and rope_scaling on top."""
  config = dict(config)
  rope = dict(config.pop('rope_parameters'))
  config['rope_theta'] = rope.pop('rope_theta')
  config['rope_scaling'] = None if rope['rope_type'] == 'default' else rope
  return config


def _checkpoint(directory, config: dict, seed=0) -> dict:
  """Random weights in Hugging Face's layout (every norm and bias away from its initial value)."""
  rng = np.random.default_rng(seed)
  D, F = config['hidden_size'], config['intermediate_size']
  H, N, V = config['num_attention_heads'], config['num_key_value_heads'], config['vocab_size']
  K = config.get('head_dim') or D // H
  w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
  tensors = {'model.embed_tokens.weight': w(V, D), 'model.norm.weight': 1 + w(D),
             'lm_head.weight': w(V, D)}
  kind = config['model_type']
  qwen2, qwen3 = kind == 'qwen2', kind in ('qwen3', 'qwen3_moe')
  for i in range(config['num_hidden_layers']):
    p = f'model.layers.{i}.'
    tensors.update({
        p + 'input_layernorm.weight': 1 + w(D), p + 'post_attention_layernorm.weight': 1 + w(D),
        p + 'self_attn.q_proj.weight': w(H * K, D), p + 'self_attn.k_proj.weight': w(N * K, D),
        p + 'self_attn.v_proj.weight': w(N * K, D), p + 'self_attn.o_proj.weight': w(D, H * K)})
    if kind in MOE_NAMES:
      block, gate, up, down = MOE_NAMES[kind]
      Fe = config.get('moe_intermediate_size', F)
      tensors[p + f'{block}.gate.weight'] = 10 * w(_experts(config), D)  # Decisive routing.
      for e in range(_experts(config)):
        q = p + f'{block}.experts.{e}.'
        tensors.update({q + f'{gate}.weight': w(Fe, D), q + f'{up}.weight': w(Fe, D),
                        q + f'{down}.weight': w(D, Fe)})
    else:
      tensors.update({p + 'mlp.gate_proj.weight': w(F, D), p + 'mlp.up_proj.weight': w(F, D),
                      p + 'mlp.down_proj.weight': w(D, F)})
    if qwen2:
      tensors.update({p + f'self_attn.{x}_proj.bias': w(n * K)
                      for x, n in (('q', H), ('k', N), ('v', N))})
    if qwen3:
      tensors.update({p + 'self_attn.q_norm.weight': 1 + w(K),
                      p + 'self_attn.k_norm.weight': 1 + w(K)})
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / 'model.safetensors'))
  (directory / 'config.json').write_text(json.dumps(config))
  return tensors


def assert_export_writes_back(host: dict, model, tensors: dict, hf_config: dict,
                              directory) -> dict:
  """Exports the parameters `host` (by path) of `model` to `directory`: exactly `tensors`, by
  the same names, and a config.json that reads back as `hf_config` does. Returns that
  config.json."""
  hf_save.save(host, model, 256, str(directory))
  with safe_open(str(directory / 'model.safetensors'), framework='numpy') as f:
    written = {name: f.get_tensor(name) for name in f.keys()}
  assert written.keys() == tensors.keys()
  for name, value in tensors.items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  out = json.loads((directory / 'config.json').read_text())
  assert hf.model_config(out, 'out') == hf.model_config(hf_config, 'in')
  return out


def _experts(config: dict) -> int:
  return config.get('num_local_experts') or config['num_experts']


def _mlp(t: dict, config: dict, i: int, h: np.ndarray) -> np.ndarray:
  """The block's SwiGLU MLP, or its mixture of experts as modeling_mixtral /
  modeling_qwen3_moe compute it: softmax over the router logits, the top k renormalised
  (norm_topk_prob), their experts' outputs weighed and summed."""
  g = lambda name: t[f'model.layers.{i}.{name}'].astype(np.float64)
  swiglu = lambda x, a, b, c: (lambda gate: gate / (1 + np.exp(-gate)) * (x @ g(b).T))(
      x @ g(a).T) @ g(c).T
  if config['model_type'] not in MOE_NAMES:
    return swiglu(h, 'mlp.gate_proj.weight', 'mlp.up_proj.weight', 'mlp.down_proj.weight')
  block, gate, up, down = MOE_NAMES[config['model_type']]
  logits = h @ g(f'{block}.gate.weight').T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[..., :config['num_experts_per_tok']]
  weights = np.take_along_axis(probs, top, -1)
  weights /= weights.sum(-1, keepdims=True)
  out = np.zeros_like(h)
  for e in range(_experts(config)):
    chosen = (weights * (top == e)).sum(-1, keepdims=True)  # 0 where e is not among the top k.
    q = f'{block}.experts.{e}.'
    out += chosen * swiglu(h, q + f'{gate}.weight', q + f'{up}.weight', q + f'{down}.weight')
  return out


def _inverse_frequencies(config: dict, K: int) -> np.ndarray:
  """modeling_rope_utils: _compute_default / _linear_scaling / _llama3 parameters."""
  rope = config.get('rope_parameters') or dict(config.get('rope_scaling') or {},
                                               rope_theta=config.get('rope_theta', 1e4))
  inv = 1.0 / rope['rope_theta'] ** (np.arange(0, K, 2) / K)
  kind = rope.get('rope_type', 'default')
  if kind == 'linear':
    return inv / rope['factor']
  if kind == 'llama3':
    old, factor = rope['original_max_position_embeddings'], rope['factor']
    low, high = old / rope['low_freq_factor'], old / rope['high_freq_factor']
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low, inv / factor, inv)
    smooth = (old / wavelen - rope['low_freq_factor']) / (
        rope['high_freq_factor'] - rope['low_freq_factor'])
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high) & ~(wavelen > low)
    return np.where(medium, smoothed, scaled)
  return inv


def reference_logits(t: dict, config: dict, tokens: np.ndarray, scale=None) -> np.ndarray:
  """The family's ForCausalLM forward in NumPy (float64): RMSNorm, q/k/v biases (Qwen2), per-head
  q/k RMSNorm before rotary (Qwen3), rotate-half rotary, grouped-query causal attention with
  logits times head_dim^-0.5 (or `scale`) within the sliding window if any, SwiGLU (or a mixture
  of SwiGLU experts, _mlp)."""
  D, H, N = config['hidden_size'], config['num_attention_heads'], config['num_key_value_heads']
  K, eps = config.get('head_dim') or D // H, config['rms_norm_eps']
  B, L = tokens.shape
  norm = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g
  angles = np.concatenate([np.arange(L)[:, None] * _inverse_frequencies(config, K)] * 2, -1)
  rot = lambda x: x * np.cos(angles) + np.concatenate([-x[..., K // 2:], x[..., :K // 2]],
                                                      -1) * np.sin(angles)
  g = lambda name: t[name].astype(np.float64)
  x = g('model.embed_tokens.weight')[tokens]
  causal = np.tril(np.ones((L, L), bool))
  window = config.get('sliding_window') if config.get('use_sliding_window', True) else None
  # Qwen2 / Qwen3 window the layers from max_window_layers on (default 28), Mistral every layer.
  first = config.get('max_window_layers', 28 if config['model_type'] in ('qwen2', 'qwen3') else 0)
  for i in range(config['num_hidden_layers']):
    mask = causal  # A query sees the keys fewer than `window` positions back.
    if window and i >= first:
      mask = causal & (np.arange(L)[:, None] - np.arange(L) < window)
    p = f'model.layers.{i}.self_attn.'
    h = norm(x, g(f'model.layers.{i}.input_layernorm.weight'))
    heads = {}
    for name, n in (('q', H), ('k', N), ('v', N)):
      y = h @ g(p + f'{name}_proj.weight').T
      if p + f'{name}_proj.bias' in t:
        y = y + g(p + f'{name}_proj.bias')
      y = y.reshape(B, L, n, K)
      if name != 'v' and p + f'{name}_norm.weight' in t:
        y = norm(y, g(p + f'{name}_norm.weight'))
      heads[name] = y.transpose(0, 2, 1, 3)
    q, k = rot(heads['q']), rot(heads['k'])
    k, v = np.repeat(k, H // N, axis=1), np.repeat(heads['v'], H // N, axis=1)
    scores = np.where(mask, q @ k.transpose(0, 1, 3, 2) * (scale or K ** -0.5), -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(B, L, H * K)
    x = x + out @ g(p + 'o_proj.weight').T
    x = x + _mlp(t, config, i, norm(x, g(f'model.layers.{i}.post_attention_layernorm.weight')))
  return norm(x, g('model.norm.weight')) @ g('lm_head.weight').T


def _engine_config(path, mesh=(1, 1, 1)):
  config = tiny_config(mesh=mesh)
  config.train.init_from = f'hf:{path}'
  config.data.seq_len = SEQ
  return config


def _tokens():
  return np.random.default_rng(1).integers(0, 256, (8, SEQ + 1)).astype(np.int32)


def assert_logits(config, directory, expected):
  """The engine's logits of the checkpoint in `directory` on one device are `expected`."""
  setup, params = load_on_one_device(config, directory)
  np.testing.assert_allclose(_engine_logits(setup, params, _tokens()[:, :-1]), expected,
                             atol=2e-4, rtol=1e-4)


def load_on_one_device(config, directory):
  """(setup, params) of the Hugging Face checkpoint in `directory` on one device."""
  setup = lay_out(config, 256, jax.devices()[:1])
  return setup, hf.load_params(str(directory), setup.abstract_state()['params'])


def _engine_logits(setup, params, tokens):
  ops = AutoOps(setup)
  forward = jax.jit(lambda p, t: ops.prepare_params(nnx.merge(setup.graphdef, p))(t, ops))
  return np.asarray(forward(params, tokens))


@pytest.mark.slow
@pytest.mark.parametrize('fmt', ['v5', 'legacy'])
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_family_loads_with_the_reference_logits(tmp_path, family, fmt):
  hf_config = FAMILIES[family] if fmt == 'v5' else legacy(FAMILIES[family])
  tensors = _checkpoint(tmp_path / 'hf', hf_config)
  config = _engine_config(tmp_path / 'hf')
  config = hf.with_model_config(config)
  model = config.model
  assert (model.name, model.hf_architecture) == ('llama', hf_config['architectures'][0])
  assert model.num_experts == (_experts(hf_config) if family in MOE_NAMES else 0)
  assert model.rope_base == FAMILIES[family]['rope_parameters']['rope_theta']
  assert model.rope_type == FAMILIES[family]['rope_parameters']['rope_type']
  assert_logits(config, tmp_path / 'hf', reference_logits(tensors, hf_config, _tokens()[:, :-1]))


def test_the_reference_sees_what_the_families_change(tmp_path):
  """Each feature moves the reference's logits far beyond the tolerance above, so the family
  tests could fail."""
  tokens = _tokens()[:2, :-1]
  for family, without in (('llama3', dict(FAMILIES['llama3'], rope_parameters={
      'rope_type': 'default', 'rope_theta': 500000.0})), ('qwen3', None), ('qwen2', None)):
    tensors = _checkpoint(tmp_path / family, FAMILIES[family])
    if without is None:  # Drop the family's own tensors: q/k norms, q/k/v biases.
      without = FAMILIES[family]
      plain = {k: v for k, v in tensors.items() if not k.endswith(('_norm.weight', '.bias'))
               or 'layernorm' in k or k == 'model.norm.weight'}
    else:
      plain = tensors
    gap = np.abs(reference_logits(tensors, FAMILIES[family], tokens) -
                 reference_logits(plain, without, tokens)).max()
    assert gap > 100 * 2e-4, (family, gap)


@pytest.fixture(scope='module')
def qwen_runs(tmp_path_factory):
  """Qwen2 (biases), Qwen3 (q/k norms, head_dim 32 != 64 / 4, llama3 rotary) and Qwen3-MoE
  (experts, dropless) on 2x2x2."""
  runs = {}
  for family, extra in (('qwen2', {}), ('qwen3', {'rope_parameters': dict(
      LLAMA3_ROPE, rope_theta=1e6)}), ('qwen3_moe', {})):
    directory = tmp_path_factory.mktemp(family)
    hf_config = dict(FAMILIES[family], **extra)
    runs[family] = (directory, hf_config, _checkpoint(directory, hf_config, seed=3))
  return runs


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_sharded_in_both_modes_the_loss_is_the_references(qwen_runs, mode):
  tokens = _tokens()
  for family, (directory, hf_config, tensors) in qwen_runs.items():
    config = _engine_config(directory, mesh=(2, 2, 2))
    config.parallelism.mode = mode
    run = assemble(config)
    params = hf.load_params(str(directory), run.setup.abstract_state()['params'])
    logits = reference_logits(tensors, hf_config, tokens[:, :-1])
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, tokens[:, 1:, None], -1).mean()
    batch = jax.device_put(tokens, run.setup.batch_sharding())
    loss = float(run.steps.eval(params, batch))
    assert abs(loss - expected) < 1e-5 * max(1.0, expected), (family, mode, loss, expected)


@pytest.mark.slow
def test_attention_scale_sets_the_logit_scale(tmp_path):
  """model.attention_scale in the einsum path, in manual mode's ring attention (context 8) and
  in the generation cache, each against the reference computed with that scale."""
  tensors = _checkpoint(tmp_path / 'hf', FAMILIES['qwen3'])
  config = _engine_config(tmp_path / 'hf')
  config = hf.with_model_config(config)
  config.model.attention_scale = 0.05
  setup = lay_out(config, 256, jax.devices()[:1])
  params = hf.load_params(str(tmp_path / 'hf'), setup.abstract_state()['params'])
  tokens = _tokens()
  expected = reference_logits(tensors, FAMILIES['qwen3'], tokens[:, :-1], scale=0.05)
  np.testing.assert_allclose(_engine_logits(setup, params, tokens[:, :-1]), expected, atol=2e-4,
                             rtol=1e-4)
  default = reference_logits(tensors, FAMILIES['qwen3'], tokens[:, :-1])
  assert np.abs(default - expected).max() > 100 * 2e-4  # The scale shows.
  # Ring attention: the sequence split 8 ways, manual mode.
  ring = _engine_config(tmp_path / 'hf', mesh=(1, 1, 1))
  ring.mesh.context, ring.parallelism.mode, ring.model.attention_scale = 8, 'manual', 0.05
  run = assemble(ring)
  ring_params = hf.load_params(str(tmp_path / 'hf'), run.setup.abstract_state()['params'])
  loss = float(run.steps.eval(ring_params, jax.device_put(tokens, run.setup.batch_sharding())))
  shifted = expected - expected.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  assert abs(loss + np.take_along_axis(log_probs, tokens[:, 1:, None], -1).mean()) < 1e-5
  # The generation cache: greedy tokens are the reference's argmax, token by token.
  prompt = tokens[0, :5]
  (generated,) = Generator(setup, 8, 4).generate(params, [prompt], 4)
  sequence = list(prompt)
  for _ in range(4):
    logits = reference_logits(tensors, FAMILIES['qwen3'], np.array([sequence]), scale=0.05)
    sequence.append(int(np.argmax(logits[0, -1])))
  assert list(generated) == sequence[5:]


@pytest.mark.parametrize('change, message', [
    ({'rope_parameters': {'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e4}},
     "rope_parameters.rope_type='yarn' is not implemented"),
    ({'rope_parameters': None, 'rope_theta': 1e4,
      'rope_scaling': {'type': 'dynamic', 'factor': 2.0}},
     "rope_scaling.rope_type='dynamic' is not implemented"),
    ({'partial_rotary_factor': 0.5}, 'partial_rotary_factor=0.5 is not supported'),
    ({'attention_bias': True}, 'attention_bias=true is not supported'),
    ({'mlp_bias': True}, 'mlp_bias=true is not supported'),
    ({'hidden_act': 'gelu'}, "hidden_act='gelu' is not supported"),
    ({'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2'},
     'the engine loads DeepseekV3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, '
     'LlamaForCausalLM, MistralForCausalLM, '
     'MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM'),
])
def test_what_the_engine_does_not_compute_is_refused(change, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(').replace('[', r'\[')):
    hf.model_config(dict(FAMILIES['llama2'], **change), 'hf:x')


@pytest.mark.parametrize('family, window', [
    ('mistral', {'sliding_window': 5}),
    ('qwen2', {'use_sliding_window': True, 'sliding_window': 5, 'max_window_layers': 0}),
])
def test_a_sliding_window_shorter_than_the_sequence(tmp_path, family, window):
  """A window of 5 over 16 positions on every layer: the einsum attention computes it (the
  window moves the reference's logits far beyond the tolerance); dot_product_attention is
  refused."""
  hf_config = dict(FAMILIES[family], **window)
  tensors = _checkpoint(tmp_path / 'hf', hf_config)
  config = hf.with_model_config(_engine_config(tmp_path / 'hf'))
  assert config.model.sliding_window == 5
  assert_logits(config, tmp_path / 'hf', reference_logits(tensors, hf_config, _tokens()[:, :-1]))
  tokens = _tokens()[:, :-1]
  full = reference_logits(tensors, dict(hf_config, sliding_window=None), tokens)
  assert np.abs(full - reference_logits(tensors, hf_config, tokens)).max() > 100 * 2e-4
  config = _engine_config(tmp_path / 'hf', mesh=(8, 1, 1))
  config.model.attention = 'dot_product_attention'
  with pytest.raises(ConfigError, match='model.sliding_window=5 is shorter than data.seq_len=16, '
                     "and model.attention='dot_product_attention' computes full causal"):
    assemble(config)


def test_qwen_windows_from_max_window_layers_on():
  """Qwen2 / Qwen3 window only the layers from max_window_layers on (default 28): past every
  layer, no window; from a middle layer, refused (the engine windows every layer alike)."""
  qwen = dict(FAMILIES['qwen2'], use_sliding_window=True, sliding_window=5)
  assert hf.model_config(qwen, 'hf:x')['sliding_window'] == 0  # 2 layers < 28.
  with pytest.raises(ConfigError, match='the sliding window on some layers only'):
    hf.model_config(dict(qwen, max_window_layers=1), 'hf:x')
  assert hf.model_config(dict(qwen, max_window_layers=0), 'hf:x')['sliding_window'] == 5
  with pytest.raises(ConfigError, match='the sliding window on some layers only'):
    hf.model_config(dict(qwen, layer_types=['full_attention', 'sliding_attention']), 'hf:x')
