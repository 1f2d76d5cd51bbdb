"""Multi-head latent attention (model.mla_*, engine/models/llama/latent_attention.py).

The layer is checked against a NumPy version written from DeepSeek-V3's modeling code (latent
projections and norms, the shared rotary key, interleaved or rotate-half rotary, logits scaled
by 1 / sqrt(K + R)), with and without the query latent; the interleaved rotary pairs are shown
to matter. The Llama with latent attention equals its single-device run in both modes on data x
fsdp x tensor (heads split) and data x tensor x stage meshes, and DeepSeek-V3's whole block
(latent attention, sigmoid group routing with the aux-free bias, a shared expert) on expert x
fsdp x tensor. Hugging Face's DeepseekV3ForCausalLM: tests/unit/test_hf_deepseek.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.models.attention.spec import AttentionSpec
from engine.models.llama.latent_attention import LATENT_NORM_EPS, LatentAttention, LatentConfig
from engine.models.llama.layers import Rope
from engine.models.ops import LocalOps
from engine.models import quantized_matmul
from tests.support.helpers import assert_same_run, engine_run, single_device_run, tiny_config

D, H, K, R, V, C, Q = 32, 4, 8, 4, 6, 12, 10


def numpy_rotary(x, positions, base, interleaved):
  """DeepSeek-V3's apply_rotary_pos_emb_interleave (pairs 2i, 2i + 1, returned as [evens'
  rotations, odds']) or Llama's rotate-half, on [..., L, n, R] (float64)."""
  n = x.shape[-1]
  inverse = base ** (-np.arange(0, n, 2) / n)
  angles = positions[:, None] * inverse  # [L, R / 2]
  cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
  first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :n // 2],
                                                                     x[..., n // 2:])
  return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


def numpy_latent_attention(x, p, q_rank, interleaved, base=10_000.0):
  """[B, L, D] -> [B, L, D] as modeling_deepseek_v3's DeepseekV3Attention computes it."""
  x = x.astype(np.float64)
  B, L, _ = x.shape
  g = lambda name: np.asarray(p[name], np.float64)
  norm = lambda y, scale: y / np.sqrt((y * y).mean(-1, keepdims=True) + LATENT_NORM_EPS) * scale
  if q_rank:
    q = norm(x @ g('w_q_a_DQ'), g('q_a_norm')) @ g('w_q_b_QHK').reshape(q_rank, -1)
  else:
    q = x @ g('w_q_DHK').reshape(D, -1)
  q = q.reshape(B, L, H, K + R)
  compressed = x @ g('w_kv_a_DC')
  kv = norm(compressed[..., :C], g('kv_a_norm')) @ g('w_kv_b_CHK').reshape(C, -1)
  kv = kv.reshape(B, L, H, K + V)
  positions = np.arange(L, dtype=np.float64)
  q_rot = numpy_rotary(q[..., K:], positions, base, interleaved)
  k_rot = numpy_rotary(compressed[..., None, C:], positions, base, interleaved)
  query = np.concatenate([q[..., :K], q_rot], -1)
  key = np.concatenate([kv[..., :K], np.broadcast_to(k_rot, (B, L, H, R))], -1)
  scores = np.einsum('bqhk,bshk->bhqs', query, key) * (K + R) ** -0.5
  scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum('bhqs,bshv->bqhv', probs, kv[..., K:])
  return out.reshape(B, L, H * V) @ g('w_o_HVD').reshape(H * V, D)


def _layer(q_rank, interleaved):
  with nnx.use_eager_sharding(False):
    layer = LatentAttention(D, H, K, LatentConfig(C, q_rank, R, V, interleaved), 0.3,
                            nnx.Rngs(0))
  state = nnx.to_pure_dict(nnx.state(layer))
  params = {name: value if not isinstance(value, dict) else value['scale']
            for name, value in state.items()}
  norms = np.random.default_rng(0).uniform(0.5, 1.5, (2, max(C, q_rank or 1)))
  layer.kv_a_norm.scale[...] = jnp.asarray(norms[0, :C])  # Away from one: a dropped norm shows.
  params['kv_a_norm'] = norms[0, :C]
  if q_rank:
    layer.q_a_norm.scale[...] = jnp.asarray(norms[1, :q_rank])
    params['q_a_norm'] = norms[1, :q_rank]
  return layer, params


@pytest.mark.parametrize('q_rank', [0, Q])
@pytest.mark.parametrize('interleaved', [True, False])
def test_the_layer_matches_deepseeks_attention_in_numpy(q_rank, interleaved):
  x = np.asarray(jax.random.normal(jax.random.key(2), (2, 7, D)))
  layer, params = _layer(q_rank, interleaved)
  y = layer(x, LocalOps(), Rope(), quantized_matmul.DEFAULT, AttentionSpec())
  expected = numpy_latent_attention(x, params, q_rank, interleaved)
  np.testing.assert_allclose(np.asarray(y), expected, atol=2e-5, rtol=1e-5)
  # The rotary pairing matters: the other one is far from this result.
  other = numpy_latent_attention(x, params, q_rank, not interleaved)
  assert np.abs(other - expected).max() > 100 * 2e-5


def mla_config(mesh=(1, 1, 1), mode='auto', deepseek=False, dense_layers=0):
  """A tiny Llama with latent attention on mesh DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]];
  `deepseek`: DeepSeek-V3's whole block (sigmoid group routing with the aux-free bias, a shared
  expert), after `dense_layers` dense ones (then 2 more layers)."""
  config = tiny_config(mesh=mesh[:3], steps=2)
  config.mesh.context, config.mesh.stage, config.mesh.expert = (*mesh[3:], 1, 1, 1)[:3]
  config.model.name, config.model.tie_embeddings = 'llama', False
  config.model.head_dim, config.model.mla_value_dim = K, V
  config.model.mla_kv_rank, config.model.mla_q_rank, config.model.mla_rope_dim = C, Q, R
  if deepseek:
    config.model.update(num_experts=4, moe_mlp_dim=16, moe_shared_expert=16,
                        moe_router='sigmoid_topk', moe_groups=2, moe_topk_groups=1,
                        moe_routed_scale=2.5, moe_balance='aux_free', moe_bias_rate=0.003,
                        moe_aux_loss_coef=0.0, moe_dense_layers=dense_layers)
    config.model.num_layers += dense_layers
  config.parallelism.mode = mode
  return config


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_latent_attention_matches_single_device(mode):
  """data 2 x fsdp 2 x tensor 2 (each device 2 of the 4 heads) and data 2 x tensor 2 x stage
  2 with 2 micro-batches; DeepSeek-V3's block (group routing, a shared expert, the aux-free
  bias) on expert 2 x fsdp 2 x tensor 2 from the first layer. Guards the experts' hidden
  dimension summed over `tensor` after auto mode's dropless exchange, and manual mode's router
  scoring every expert (its expert dimension split over `expert` fails it)."""
  reference = single_device_run(mla_config(), 2)
  assert_same_run(engine_run(mla_config((2, 2, 2), mode), mode, 2), reference)
  staged = mla_config((2, 1, 2, 1, 2), mode)
  staged.train.microbatches = 2
  assert_same_run(engine_run(staged, mode, 2), reference)
  assert_same_run(engine_run(mla_config((1, 2, 2, 1, 1, 2), mode, True), mode, 2),
                  single_device_run(mla_config(deepseek=True), 2))


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_dense_first_layers_match_single_device(mode):
  """DeepSeek-V3's blocks after a dense one on expert 2 x fsdp 2 x tensor 2, and on data 2 x
  stage 2 x expert 2 with 2 micro-batches (the dense layer runs before the pipeline). Guards
  each stage's layers counting on from the stage before (the router biases move by their own
  layer's load): auto GPipe's stages keeping their own layer counters fails it."""
  reference = single_device_run(mla_config(deepseek=True, dense_layers=1), 2)
  assert_same_run(engine_run(mla_config((1, 2, 2, 1, 1, 2), mode, True, 1), mode, 2), reference)
  staged = mla_config((2, 1, 1, 1, 2, 2), mode, True, 1)
  staged.train.microbatches = 2
  assert_same_run(engine_run(staged, mode, 2), reference)
