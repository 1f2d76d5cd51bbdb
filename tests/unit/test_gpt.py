"""The GPT model (engine/models/gpt.py) against an independent NumPy forward pass.

The reference is written from the model's definition, not from its code, in float64:

- Embeddings: token embedding tok_embed_VD[token] plus a learned position embedding
  pos_embed_LD[position], positions 0 .. L-1 (absolute, no scaling of either).
- Blocks, pre-LayerNorm: x += attention(LN_attn(x)); x += mlp(LN_mlp(x)).
- LayerNorm: (x - mean) / sqrt(var + eps) * scale + bias over the last dimension, the biased
  variance (mean of squared deviations), eps = model.norm_eps (1e-5) inside the square root.
- Attention: one fused projection w_qkv_CDHK [3, D, H, K] (q, k, v in that order), no biases;
  queries scaled by 1/sqrt(K) (K = head_dim = D / H); causal mask (position q sees keys <= q);
  softmax over keys; output projection w_out_HKD [H, K, D] contracting heads and head_dim, no bias.
- MLP: gelu(x w_up_DF + b_up_F) w_down_FD + b_down_D, GELU in its tanh approximation
  (jax.nn.gelu's default, GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
- A final LayerNorm, then logits = x tok_embed_VD^T (model.tie_embeddings, the default) or
  x head_DV (untied; no bias). No dropout.

The parameters are the engine's own initialisation (single device, float32), with a larger
init_std so that attention is far from uniform (at 0.02 every softmax is nearly flat and the
attention scale barely shows), and with the constant-initialised ones (LayerNorm scales 1,
LayerNorm and MLP biases 0) perturbed so that each is exercised. The test also checks that
references with a known mistake (no causal mask, a wrong attention scale, exact GELU, no position
embeddings, ...) are far outside the tolerance, so that it can fail.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from engine.assemble import lay_out
from tests.support.helpers import tiny_config

VOCAB = 256
# The float32 engine against float64 NumPy, as max |difference| / max |logit| (about 10):
# measured 8e-7. The mistakes below measure 1.6e-4 (exact GELU for the tanh approximation) to
# 0.97 (no causal mask); each must exceed 10 x RTOL.
RTOL = 5e-6


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _gelu_exact(x):
  from math import erf
  return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def reference_logits(p, tokens_BL, eps, tied, causal=True, scale='sqrt', gelu=_gelu_tanh,
                     positions=True, pre_norm=True):
  """GPT's forward pass in float64 NumPy. The keyword arguments after `tied` exist only to
  break it on purpose (the sensitivity checks): the defaults are the model's definition."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  B, L = tokens_BL.shape
  blocks = p['blocks']
  num_layers, _, D, H, K = blocks['w_qkv_CDHK'].shape

  def layer_norm(x, ln):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * ln['scale'] + ln['bias']

  x_BLD = p['tok_embed_VD'][tokens_BL]
  if positions:
    x_BLD = x_BLD + p['pos_embed_LD'][np.arange(L)]
  visible_QS = np.tril(np.ones((L, L), bool)) if causal else np.ones((L, L), bool)
  q_scale = {'sqrt': K ** -0.5, 'none': 1.0, 'inverse': 1.0 / K}[scale]
  for i in range(num_layers):
    w = jax.tree.map(lambda a: a[i], blocks)
    h_BLD = layer_norm(x_BLD, w['ln_attn']) if pre_norm else x_BLD
    q_BLHK, k_BLHK, v_BLHK = (np.einsum('bld,dhk->blhk', h_BLD, w['w_qkv_CDHK'][c])
                              for c in range(3))
    scores_BHQS = np.einsum('bqhk,bshk->bhqs', q_BLHK * q_scale, k_BLHK)
    scores_BHQS = np.where(visible_QS, scores_BHQS, -np.inf)
    probs_BHQS = np.exp(scores_BHQS - scores_BHQS.max(-1, keepdims=True))
    probs_BHQS /= probs_BHQS.sum(-1, keepdims=True)
    out_BLHK = np.einsum('bhqs,bshk->bqhk', probs_BHQS, v_BLHK)
    x_BLD = x_BLD + np.einsum('blhk,hkd->bld', out_BLHK, w['w_out_HKD'])
    h_BLD = layer_norm(x_BLD, w['ln_mlp']) if pre_norm else x_BLD
    hidden_BLF = gelu(h_BLD @ w['w_up_DF'] + w['b_up_F'])
    x_BLD = x_BLD + hidden_BLF @ w['w_down_FD'] + w['b_down_D']
  x_BLD = layer_norm(x_BLD, p['ln_final'])
  return x_BLD @ (p['tok_embed_VD'].T if tied else p['head_DV'])


def _perturbed(params, seed=1):
  """The engine's parameters with every constant-initialised one (LayerNorm scale 1, LayerNorm
  and MLP biases 0) moved by seeded noise; the random-initialised ones as the engine made them."""
  rng = np.random.default_rng(seed)

  def perturb(value):
    value = np.asarray(value)
    if np.all(value == value.flat[0]):  # Constant: ones or zeros.
      value = value + 0.2 * rng.standard_normal(value.shape).astype(np.float32)
    return value

  return jax.tree.map(perturb, params)


@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
def test_forward_matches_numpy_reference(tied):
  config = tiny_config()  # 2 layers, 4 heads of 8, width 32, MLP 64, 16 positions.
  config.model.tie_embeddings = tied
  config.model.init_std = 0.4
  train_setup = lay_out(config, VOCAB, jax.devices()[:1])
  model = train_setup.model
  assert (model.name, model.vocab_size) == ('gpt', VOCAB)
  state, _ = train_setup.init(config.seed)
  params = _perturbed(jax.device_get(state['params']))
  initial = jax.tree_util.tree_leaves_with_path(jax.device_get(state['params']))
  constant = {jax.tree_util.keystr(path) for path, value in initial
              if np.all(np.asarray(value) == np.asarray(value).flat[0])}
  assert constant == {"['blocks']['ln_attn']['scale']", "['blocks']['ln_attn']['bias']",
                      "['blocks']['ln_mlp']['scale']", "['blocks']['ln_mlp']['bias']",
                      "['ln_final']['scale']", "['ln_final']['bias']",
                      "['blocks']['b_up_F']", "['blocks']['b_down_D']"}, constant
  assert ('head_DV' in params) != tied
  tokens_BL = np.random.default_rng(0).integers(0, VOCAB, (4, config.model.max_len))

  logits = np.asarray(nnx.merge(train_setup.graphdef, params)(tokens_BL))
  assert logits.dtype == np.float32 and logits.shape == (4, config.model.max_len, VOCAB)
  eps = config.model.norm_eps
  expected = reference_logits(params, tokens_BL, eps, tied)
  scale = np.abs(expected).max()
  error = np.abs(logits - expected).max() / scale
  assert error < RTOL, error

  # The check can fail: each of these mistakes moves the logits far outside the tolerance.
  mistakes = {
      'no causal mask': dict(causal=False),
      'no attention scale': dict(scale='none'),
      'attention scale 1/K': dict(scale='inverse'),
      'exact GELU': dict(gelu=_gelu_exact),
      'no position embeddings': dict(positions=False),
      'no LayerNorm before attention and MLP': dict(pre_norm=False),
  }
  if not tied:
    mistakes['the token embedding as the head'] = dict(tied=True)
  for name, change in mistakes.items():
    wrong = reference_logits(params, tokens_BL, eps, **{'tied': tied, **change})
    assert np.abs(logits - wrong).max() / scale > 10 * RTOL, name
