"""The Llama family's registry entry: its `model` config subtree read into a LlamaConfig
(engine/models/llama/model.py), and the model's sizes the planner and MFU read (matmul weights,
FLOPs per token, quantized weights), returned as its ModelSpec.
"""

from __future__ import annotations

import dataclasses

from engine.models import quantized_matmul
from engine.models.attention import spec as attention_spec
from engine.models.attention.spec import AttentionSpec
from engine.models.llama import lora
from engine.models.llama.latent_attention import LatentConfig
from engine.models.llama.model import Llama, LlamaConfig
from engine.models.llama.layers import Rope
from engine.models.moe.layer import MoeConfig
from engine.models.moe.config import stacked_layers
from engine.models.spec import ExpertsSpec, ModelSpec


def moe_config(model_config) -> MoeConfig | None:
  """The mixture of experts of the model.moe_* keys; None for a dense model."""
  if not model_config.get('num_experts', 0):
    return None
  return MoeConfig(
      num_experts=model_config.num_experts,
      mlp_dim=model_config.moe_mlp_dim or model_config.mlp_dim,
      experts_per_token=model_config.experts_per_token, router=model_config.moe_router,
      shared_expert_dim=model_config.moe_shared_expert, dispatch=model_config.moe_dispatch,
      capacity_factor=model_config.moe_capacity_factor,
      aux_loss_coef=model_config.moe_aux_loss_coef, z_loss_coef=model_config.moe_z_loss_coef,
      groups=model_config.moe_groups, topk_groups=model_config.moe_topk_groups,
      routed_scale=model_config.moe_routed_scale, balance=model_config.moe_balance,
      bias_rate=model_config.moe_bias_rate,
      matmul=quantized_matmul.from_config(model_config))


def attention(model_config) -> AttentionSpec:
  """Every layer's attention: the engine-wide keys' spec with this family's soft cap and sliding
  window. Only the einsum path reads the window (validation refuses a window shorter than the
  sequence on the others), so elsewhere it is left out."""
  window = model_config.sliding_window if model_config.attention == 'einsum' else 0
  return dataclasses.replace(attention_spec.from_config(model_config),
                             softcap=model_config.attention_softcap or None,
                             window=window or None)


def build(model_config, vocab_size: int) -> ModelSpec:
  """The registry entry: Llama from the `model` config subtree."""
  kv_heads = model_config.num_kv_heads if model_config.num_kv_heads > 0 else (
      model_config.num_heads)
  cfg = LlamaConfig(
      vocab_size=vocab_size, num_layers=model_config.num_layers,
      num_heads=model_config.num_heads, num_kv_heads=kv_heads,
      embed_dim=model_config.embed_dim, mlp_dim=model_config.mlp_dim,
      head_dim=(model_config.head_dim if model_config.head_dim > 0 else
                model_config.embed_dim // model_config.num_heads),
      rope=Rope(model_config.rope_base, model_config.rope_type, model_config.rope_factor,
                model_config.rope_low_freq_factor, model_config.rope_high_freq_factor,
                model_config.rope_original_max_len),
      norm_eps=model_config.norm_eps, attention=attention(model_config),
      qkv_bias=model_config.qkv_bias,
      qk_norm=model_config.qk_norm, scan_layers=model_config.scan_layers,
      init_std=model_config.init_std, moe=moe_config(model_config),
      matmul=quantized_matmul.from_config(model_config), latent=latent_config(model_config),
      dense_layers=model_config.num_layers - stacked_layers(model_config),
      lora=lora.from_config(model_config), post_norms=model_config.post_norms,
      mlp_activation=model_config.mlp_activation, embed_scale=model_config.embed_scale,
      logit_softcap=model_config.logit_softcap or None, global_every=model_config.global_every,
      local_rope=Rope(model_config.rope_local_base) if model_config.rope_local_base else None)
  D = cfg.embed_dim
  adapters = lora.is_adapter if cfg.lora else None
  attention_params, score_width = _attention_sizes(cfg)
  mlp_params, projected = _mlp_sizes(cfg)
  matmul_params = cfg.num_layers * attention_params + mlp_params + vocab_size * D
  quantized_params = cfg.num_layers * attention_params + projected

  def flops_per_token(seq_len: int) -> float:
    # As GPT's: 6 per weight, and attention's scores and weighted sum over seq_len positions.
    return 6.0 * matmul_params + 6.0 * cfg.num_layers * seq_len * score_width

  return ModelSpec(
      name='llama', factory=lambda rngs: Llama(cfg, rngs), vocab_size=vocab_size,
      separable_head=True, untied_embeddings=True,
      embed_dim=D, num_layers=cfg.num_layers,
      # The routed experts' down projection finishes on the routed rows, not on [B, L, D]
      # (engine.analysis.comm_theory counts it with the experts' exchange).
      row_parallel_per_layer=('heads', 'mlp') if not cfg.moe or cfg.moe.shared_expert_dim else (
          ('heads',)),
      flops_per_token=flops_per_token, split_where_divisible=('kv_heads',),
      # LoRA: only the adapters train, and a base checkpoint lacks them.
      trainable=adapters, added=adapters,
      context_parallel=True, experts=_experts_spec(cfg.moe),
      quantized_params=quantized_params if cfg.matmul.quantized else 0,
      latent_cache=(cfg.latent.kv_rank, cfg.latent.rope_dim) if cfg.latent else None,
      first_layers=cfg.dense_layers)


def latent_config(model_config) -> LatentConfig | None:
  """Multi-head latent attention of the model.mla_* keys; None for the Llama attention."""
  if not model_config.get('mla_kv_rank', 0):
    return None
  head_dim = (model_config.head_dim if model_config.head_dim > 0 else
              model_config.embed_dim // model_config.num_heads)
  return LatentConfig(model_config.mla_kv_rank, model_config.mla_q_rank,
                      model_config.mla_rope_dim, model_config.mla_value_dim or head_dim,
                      model_config.mla_rope_interleave)


def _attention_sizes(cfg: LlamaConfig) -> tuple[int, int]:
  """(the attention's projection weights per layer, the widths a query's scores and weighted
  sum multiply per position: H (K_qk + K_v))."""
  D, H, K = cfg.embed_dim, cfg.num_heads, cfg.head_dim
  latent = cfg.latent
  if latent is None:
    return 2 * D * H * K + 2 * D * cfg.num_kv_heads * K, 2 * H * K
  R, V, C, Q = latent.rope_dim, latent.value_dim, latent.kv_rank, latent.q_rank
  queries = D * Q + Q * H * (K + R) if Q else D * H * (K + R)
  return queries + D * (C + R) + C * H * (K + V) + H * V * D, H * (K + R + V)


def _mlp_sizes(cfg: LlamaConfig) -> tuple[float, float]:
  """(the MLP weights one token multiplies, over all layers: a mixture of experts' router, its k
  experts and shared expert; those matmul_precision quantizes: the MLPs', a shared expert's and,
  under the capacity dispatch, the k experts')."""
  D, F, moe = cfg.embed_dim, cfg.mlp_dim, cfg.moe
  if moe is None:
    return cfg.num_layers * 3 * D * F, cfg.num_layers * 3 * D * F
  sparse = cfg.num_layers - cfg.dense_layers
  routed = moe.experts_per_token * moe.mlp_dim
  active = routed + moe.shared_expert_dim + moe.num_experts / 3
  quantized = moe.shared_expert_dim + (routed if moe.dispatch == 'capacity' else 0)
  return (3 * D * (cfg.dense_layers * F + sparse * active),
          3 * D * (cfg.dense_layers * F + sparse * quantized))


def _experts_spec(moe: MoeConfig | None) -> ExpertsSpec | None:
  if moe is None:
    return None
  return ExpertsSpec(moe.num_experts, moe.experts_per_token,
                     moe.capacity_factor if moe.dispatch == 'capacity' else 0.0,
                     bool(moe.shared_expert_dim),
                     moe.bias_rate if moe.balance == 'aux_free' else 0.0)
