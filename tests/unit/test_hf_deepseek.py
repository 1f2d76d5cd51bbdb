"""DeepSeek-V3's Hugging Face checkpoints (`DeepseekV3ForCausalLM`,
engine/models/formats/deepseek.py): a NumPy forward written from transformers' modeling_deepseek_v3
(latent attention with interleaved rotary pairs, sigmoid scores with the correction bias choosing
within the best groups, weights renormalised and scaled, a shared expert; dense first layers)
against the engine's logits of the same checkpoint in both config formats; the export writes back
the same tensors and a config that reads back the same; what the engine refuses. transformers
itself: engine.analysis.hf_check's deepseek_v3 rows (docs/benchmarks.md)."""

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine import models
from engine.assemble import lay_out
from engine.config import default_config
from engine.errors import ConfigError
from engine.hf import load as hf
from tests.parity.test_latent_attention import numpy_rotary
from tests.unit.test_hf_families import (BASE, SEQ, _engine_config, _engine_logits, _tokens,
                                         assert_export_writes_back, legacy)

E, KV_RANK, Q_RANK, ROPE, NOPE, VALUE, EXPERT = 8, 16, 24, 8, 16, 12, 32
DEEPSEEK = dict(BASE, architectures=['DeepseekV3ForCausalLM'], model_type='deepseek_v3',
                num_key_value_heads=4, head_dim=ROPE, kv_lora_rank=KV_RANK, q_lora_rank=Q_RANK,
                qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=VALUE,
                n_routed_experts=E, num_experts_per_tok=2, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, moe_intermediate_size=EXPERT, n_shared_experts=1,
                first_k_dense_replace=0, norm_topk_prob=True, rope_interleave=True,
                attention_bias=False, rope_parameters={'rope_type': 'default',
                                                       'rope_theta': 10000.0})


def _checkpoint(directory, config: dict, seed=0) -> dict:
  rng = np.random.default_rng(seed)
  D, H, V = config['hidden_size'], config['num_attention_heads'], config['vocab_size']
  w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
  tensors = {'model.embed_tokens.weight': w(V, D), 'model.norm.weight': 1 + w(D),
             'lm_head.weight': w(V, D)}
  for i in range(config['num_hidden_layers']):
    p, a, m = f'model.layers.{i}.', f'model.layers.{i}.self_attn.', f'model.layers.{i}.mlp.'
    tensors.update({
        p + 'input_layernorm.weight': 1 + w(D), p + 'post_attention_layernorm.weight': 1 + w(D),
        a + 'q_a_proj.weight': w(Q_RANK, D), a + 'q_a_layernorm.weight': 1 + w(Q_RANK),
        a + 'q_b_proj.weight': w(H * (NOPE + ROPE), Q_RANK),
        a + 'kv_a_proj_with_mqa.weight': w(KV_RANK + ROPE, D),
        a + 'kv_a_layernorm.weight': 1 + w(KV_RANK),
        a + 'kv_b_proj.weight': w(H * (NOPE + VALUE), KV_RANK),
        a + 'o_proj.weight': w(D, H * VALUE),
    })
    if i < config['first_k_dense_replace']:  # A dense layer: Llama's MLP.
      F = config['intermediate_size']
      tensors.update({m + 'gate_proj.weight': w(F, D), m + 'up_proj.weight': w(F, D),
                      m + 'down_proj.weight': w(D, F)})
      continue
    tensors.update({
        m + 'gate.weight': 10 * w(E, D), m + 'gate.e_score_correction_bias': w(E),
        **{m + f'shared_experts.{n}.weight': w(*s) for n, s in (
            ('gate_proj', (EXPERT, D)), ('up_proj', (EXPERT, D)), ('down_proj', (D, EXPERT)))}})
    for e in range(E):
      q = m + f'experts.{e}.'
      tensors.update({q + 'gate_proj.weight': w(EXPERT, D), q + 'up_proj.weight': w(EXPERT, D),
                      q + 'down_proj.weight': w(D, EXPERT)})
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / 'model.safetensors'))
  (directory / 'config.json').write_text(json.dumps(config))
  return tensors


def _moe(t, config, i, h):
  """DeepseekV3MoE: sigmoid scores; the bias added for the choice (groups scored by their two
  best); the chosen experts' plain scores renormalised and scaled; plus the shared expert. The
  first first_k_dense_replace layers: DeepseekV3MLP."""
  g = lambda name: t[f'model.layers.{i}.mlp.{name}'].astype(np.float64)
  swiglu = lambda x, p: (lambda gate: gate / (1 + np.exp(-gate)) * (x @ g(p + 'up_proj.weight').T))(
      x @ g(p + 'gate_proj.weight').T) @ g(p + 'down_proj.weight').T
  if i < config['first_k_dense_replace']:
    return swiglu(h, '')
  scores = 1 / (1 + np.exp(-(h @ g('gate.weight').T)))
  choice = scores + g('gate.e_score_correction_bias')
  groups = config['n_group']
  by_group = choice.reshape(*choice.shape[:-1], groups, -1)
  group_scores = np.sort(by_group, -1)[..., -2:].sum(-1)
  best = np.argsort(-group_scores, -1, kind='stable')[..., :config['topk_group']]
  keep = (np.arange(groups) == best[..., None]).any(-2)
  choice = np.where(np.repeat(keep, E // groups, -1), choice, -np.inf)
  top = np.argsort(-choice, -1, kind='stable')[..., :config['num_experts_per_tok']]
  weights = np.take_along_axis(scores, top, -1)
  weights = weights / weights.sum(-1, keepdims=True) * config['routed_scaling_factor']
  out = swiglu(h, 'shared_experts.')
  for e in range(E):
    out += (weights * (top == e)).sum(-1, keepdims=True) * swiglu(h, f'experts.{e}.')
  return out


def reference_logits(t: dict, config: dict, tokens: np.ndarray) -> np.ndarray:
  H, eps = config['num_attention_heads'], config['rms_norm_eps']
  B, L = tokens.shape
  norm = lambda x, w, e=eps: x / np.sqrt((x * x).mean(-1, keepdims=True) + e) * w
  g = lambda name: t[name].astype(np.float64)
  positions = np.arange(L, dtype=np.float64)
  rotate = lambda x: numpy_rotary(x, positions, 10000.0, config['rope_interleave'])
  x = g('model.embed_tokens.weight')[tokens]
  for i in range(config['num_hidden_layers']):
    a = f'model.layers.{i}.self_attn.'
    h = norm(x, g(f'model.layers.{i}.input_layernorm.weight'))
    q = norm(h @ g(a + 'q_a_proj.weight').T, g(a + 'q_a_layernorm.weight'), 1e-6)
    q = (q @ g(a + 'q_b_proj.weight').T).reshape(B, L, H, NOPE + ROPE)
    compressed = h @ g(a + 'kv_a_proj_with_mqa.weight').T
    kv = norm(compressed[..., :KV_RANK], g(a + 'kv_a_layernorm.weight'), 1e-6)
    kv = (kv @ g(a + 'kv_b_proj.weight').T).reshape(B, L, H, NOPE + VALUE)
    query = np.concatenate([q[..., :NOPE], rotate(q[..., NOPE:])], -1)
    key = np.concatenate([kv[..., :NOPE], np.broadcast_to(
        rotate(compressed[..., None, KV_RANK:]), (B, L, H, ROPE))], -1)
    scores = np.einsum('bqhk,bshk->bhqs', query, key) * (NOPE + ROPE) ** -0.5
    scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum('bhqs,bshv->bqhv', probs, kv[..., NOPE:]).reshape(B, L, H * VALUE)
    x = x + out @ g(a + 'o_proj.weight').T
    x = x + _moe(t, config, i, norm(x, g(f'model.layers.{i}.post_attention_layernorm.weight')))
  return norm(x, g('model.norm.weight')) @ g('lm_head.weight').T


@pytest.mark.slow
@pytest.mark.parametrize('fmt, dense', [('v5', 0), ('legacy', 0), ('v5', 1)])
def test_deepseek_v3_loads_with_the_reference_logits_and_exports_back(tmp_path, fmt, dense):
  """The v5 and legacy config formats; a dense first layer (first_k_dense_replace=1)."""
  hf_config = dict(DEEPSEEK if fmt == 'v5' else legacy(DEEPSEEK), first_k_dense_replace=dense)
  tensors = _checkpoint(tmp_path / 'hf', hf_config)
  config = hf.with_model_config(_engine_config(tmp_path / 'hf'))
  model = config.model
  assert (model.mla_kv_rank, model.mla_q_rank, model.mla_rope_dim, model.head_dim,
          model.mla_value_dim, model.num_experts, model.moe_shared_expert, model.moe_balance,
          model.moe_dense_layers) == (KV_RANK, Q_RANK, ROPE, NOPE, VALUE, E, EXPERT, 'aux_free',
                                      dense)
  setup = lay_out(config, 256, jax.devices()[:1])
  params = hf.load_params(str(tmp_path / 'hf'), setup.abstract_state()['params'])
  tokens = _tokens()[:, :-1]
  np.testing.assert_allclose(_engine_logits(setup, params, tokens),
                             reference_logits(tensors, hf_config, tokens), atol=2e-4, rtol=1e-4)
  host = {path: np.asarray(v) for path, v in hf.by_path(params).items()}
  assert_export_writes_back(host, model, tensors, hf_config, tmp_path / 'out')


def test_the_reference_sees_the_bias_and_the_rotary_pairs(tmp_path):
  tensors = _checkpoint(tmp_path, DEEPSEEK)
  tokens = _tokens()[:2, :SEQ]
  expected = reference_logits(tensors, DEEPSEEK, tokens)
  unbiased = {n: (0 * v if n.endswith('e_score_correction_bias') else v)
              for n, v in tensors.items()}
  assert np.abs(reference_logits(unbiased, DEEPSEEK, tokens) - expected).max() > 100 * 2e-4
  halves = dict(DEEPSEEK, rope_interleave=False)
  assert np.abs(reference_logits(tensors, halves, tokens) - expected).max() > 100 * 2e-4
  # A dense first layer's MLP counts: without it the logits are far off.
  first_dense = dict(DEEPSEEK, first_k_dense_replace=1)
  dense_tensors = _checkpoint(tmp_path / 'dense', first_dense)
  no_mlp = {n: 0 * v if n.startswith('model.layers.0.mlp.') else v
            for n, v in dense_tensors.items()}
  assert np.abs(reference_logits(dense_tensors, first_dense, tokens) -
                reference_logits(no_mlp, first_dense, tokens)).max() > 100 * 2e-4


@pytest.mark.parametrize('change, message', [
    ({'first_k_dense_replace': 2}, 'first_k_dense_replace=2 makes all 2 layers dense'),
    ({'norm_topk_prob': False}, 'norm_topk_prob=false is not supported'),
    ({'scoring_func': 'softmax'}, "scoring_func='softmax' is not supported"),
    ({'attention_bias': True}, 'attention_bias=true is not supported'),
    ({'rope_parameters': {'rope_type': 'yarn', 'factor': 40.0, 'rope_theta': 1e4}},
     "rope_type='yarn' is not implemented"),
])
def test_what_the_engine_does_not_compute_is_refused(change, message):
  with pytest.raises(ConfigError, match=message):
    hf.model_config(dict(DEEPSEEK, **change), 'hf:x')
  hf.model_config(DEEPSEEK, 'hf:x')  # The unchanged config loads.


def test_a_latent_mixture_of_experts_exports_as_deepseek_v3_only_when_it_can():
  model = default_config().model
  model.name, model.num_experts, model.mla_kv_rank = 'llama', 4, 16
  model.moe_router, model.moe_balance = 'sigmoid_topk', 'aux_free'
  fmt = models.hf_format_for(model)
  assert fmt.architecture == 'DeepseekV3ForCausalLM' and not models.unwritable(fmt, model)
  model.moe_balance = 'aux_loss'
  assert 'router bias' in models.unwritable(models.hf_format_for(model), model)
  model.num_experts = 0  # Dense latent attention: no format writes it.
  assert models.hf_format_for(model) is None
  mixtral = models.HF_FORMATS['MixtralForCausalLM']
  assert 'no latent attention' in models.unwritable(mixtral, model)
