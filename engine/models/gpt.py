"""A GPT-2-style decoder in Flax NNX with logical axis names on every parameter.

Token + learned position embeddings, pre-LayerNorm blocks (causal multi-head attention, GELU
MLP), a final LayerNorm and an output projection (tied to the token embedding or not). Blocks are
stacked along a leading `layers` axis and applied with `nnx.scan`, so compile time does not grow
with depth. The model never decides how it is distributed: it names its dimensions in Flax's
sharding metadata and calls `ops` (engine/models/ops.py) where a layout may need to constrain or
communicate. It plugs into the engine through `build` (engine/models/spec.py).

Shape suffixes: B batch, L length, D embed, H heads, K head_dim, F mlp hidden, V vocab, C=3 (qkv).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models import quantized_matmul
from engine.models.attention import spec as attention_spec
from engine.models.attention.spec import AttentionSpec
from engine.models.layers import apply_layers, dense, param, stack_layers
from engine.models.ops import LocalOps
from engine.models.quantized_matmul import MatmulPrecision
from engine.models.spec import ModelSpec



@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int
  num_layers: int
  num_heads: int
  embed_dim: int
  mlp_dim: int
  max_len: int
  tie_embeddings: bool = True
  scan_layers: bool = True
  init_std: float = 0.02
  norm_eps: float = 1e-5
  attention: AttentionSpec = AttentionSpec()
  matmul: MatmulPrecision = quantized_matmul.DEFAULT  # The projections' (not the head's).

  @property
  def head_dim(self) -> int:
    return self.embed_dim // self.num_heads


class LayerNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
    self.scale = param(rngs, (dim,), ('norm',), None)
    self.bias = param(rngs, (dim,), ('norm',), 0)
    self.eps = eps

  def __call__(self, x_BLD, ops):
    x = x_BLD.astype(jnp.float32)  # Statistics in float32 whatever the compute dtype.
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...] + self.bias[...]).astype(x_BLD.dtype)


class Block(nnx.Module):
  """Pre-LN transformer block. The qkv and MLP-up projections are column-parallel (their output
  dimension is `heads` / `mlp`); the attention-out and MLP-down projections contract over it and
  are row-parallel, so each is followed by `ops.finish_contraction`."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    D, H, K, F = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    residual_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5  # GPT-2's scaled residual init.
    self.cfg = cfg
    self.ln_attn = LayerNorm(D, cfg.norm_eps, rngs)
    self.w_qkv_CDHK = param(rngs, (3, D, H, K), ('qkv', 'embed', 'heads', 'head_dim'),
                             cfg.init_std)
    self.w_out_HKD = param(rngs, (H, K, D), ('heads', 'head_dim', 'embed'), residual_std)
    self.ln_mlp = LayerNorm(D, cfg.norm_eps, rngs)
    self.w_up_DF = param(rngs, (D, F), ('embed', 'mlp'), cfg.init_std)
    self.b_up_F = param(rngs, (F,), ('mlp',), 0)
    self.w_down_FD = param(rngs, (F, D), ('mlp', 'embed'), residual_std)
    self.b_down_D = param(rngs, (D,), ('embed',), 0)

  def attention(self, x_BLD, ops):
    x_BLD = ops.column_parallel_input(x_BLD, 'heads')  # Feeds the q, k and v projections.
    w_qkv_CDHK = self.w_qkv_CDHK[...]
    heads = ('batch', 'length', 'heads', 'head_dim')
    q_BLHK, k_BLHK, v_BLHK = (
        ops.constrain(dense(x_BLD, w_qkv_CDHK[c], precision=self.cfg.matmul), heads)
        for c in range(3))
    out_BLHK = ops.attention(q_BLHK, k_BLHK, v_BLHK, self.cfg.attention)
    y_BLD = dense(out_BLHK, self.w_out_HKD[...], in_dims=2, precision=self.cfg.matmul)
    return ops.finish_contraction(y_BLD, 'heads')

  def mlp(self, x_BLD, ops):
    h_BLF = dense(x_BLD, self.w_up_DF[...], precision=self.cfg.matmul) + self.b_up_F[...]
    h_BLF = ops.constrain(jax.nn.gelu(h_BLF), ('batch', 'length', 'mlp'))
    y_BLD = dense(h_BLF, self.w_down_FD[...], precision=self.cfg.matmul)
    return ops.finish_contraction(y_BLD, 'mlp') + self.b_down_D[...]

  def __call__(self, x_BLD, ops):
    x_BLD = x_BLD + self.attention(self.ln_attn(x_BLD, ops), ops)
    x_BLD = ops.constrain(x_BLD, ('batch', 'length', 'embed'))
    x_BLD = x_BLD + self.mlp(self.ln_mlp(x_BLD, ops), ops)
    return ops.constrain(x_BLD, ('batch', 'length', 'embed'))


class GPT(nnx.Module):

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    V, D = cfg.vocab_size, cfg.embed_dim
    self.tok_embed_VD = param(rngs, (V, D), ('vocab', 'embed'), cfg.init_std)
    self.pos_embed_LD = param(rngs, (cfg.max_len, D), (None, 'embed'), cfg.init_std)

    self.blocks = stack_layers(lambda rngs: Block(cfg, rngs), cfg.num_layers, rngs)
    self.ln_final = LayerNorm(D, cfg.norm_eps, rngs)
    if not cfg.tie_embeddings:
      self.head_DV = param(rngs, (D, V), ('embed', 'vocab'), cfg.init_std)

  def __call__(self, tokens_BL: jax.Array, ops=LocalOps()) -> jax.Array:
    """Logits for every position of `tokens_BL`."""
    return self.head_logits(self.features(tokens_BL, ops), ops)

  def features(self, tokens_BL: jax.Array, ops=LocalOps()) -> jax.Array:
    """The normalised features [B, L, D] that `head_logits` projects (a chunked loss projects
    them a slice at a time)."""
    length = tokens_BL.shape[1]
    x_BLD = ops.embed_lookup(self.tok_embed_VD[...], tokens_BL)
    x_BLD = x_BLD + jnp.take(self.pos_embed_LD[...], ops.positions(length), axis=0)
    x_BLD = ops.constrain(x_BLD, ('batch', 'length', 'embed'))

    # scan_layers=False unrolls the loop completely: straight-line HLO, one copy per layer.
    unroll = 1 if self.cfg.scan_layers else self.cfg.num_layers
    return self.ln_final(apply_layers(self.blocks, x_BLD, ops, unroll), ops)

  def head_logits(self, x_BLD: jax.Array, ops=LocalOps()) -> jax.Array:
    """Logits of normalised features (any number of positions) in the compute dtype
    (engine/models/cross_entropy.py says why that is precise enough)."""
    if self.cfg.tie_embeddings:
      logits_BLV = jnp.einsum('BLD,VD->BLV', x_BLD, self.tok_embed_VD[...])
    else:
      logits_BLV = dense(x_BLD, self.head_DV[...])
    return ops.constrain(logits_BLV, ('batch', 'length', 'vocab'))


def build(model_config, vocab_size: int) -> ModelSpec:
  """The registry entry: GPT from the `model` config subtree."""
  cfg = GPTConfig(
      vocab_size=vocab_size, num_layers=model_config.num_layers,
      num_heads=model_config.num_heads, embed_dim=model_config.embed_dim,
      mlp_dim=model_config.mlp_dim, max_len=model_config.max_len,
      tie_embeddings=model_config.tie_embeddings, scan_layers=model_config.scan_layers,
      init_std=model_config.init_std, norm_eps=model_config.norm_eps,
      attention=attention_spec.from_config(model_config),
      matmul=quantized_matmul.from_config(model_config))
  D, F, HK = cfg.embed_dim, cfg.mlp_dim, cfg.num_heads * cfg.head_dim
  # Weights that multiply activations: qkv, attention out, MLP up and down, the output head.
  matmul_params = cfg.num_layers * (4 * D * HK + 2 * D * F) + vocab_size * D

  def flops_per_token(seq_len: int) -> float:
    # 6 per weight (forward multiply-add, two in the backward pass); attention scores and their
    # weighted sum: 2 x 2 x seq_len x HK forward per layer, times 3 with the backward pass.
    return 6.0 * matmul_params + 12.0 * cfg.num_layers * seq_len * HK

  return ModelSpec(
      name='gpt', factory=lambda rngs: GPT(cfg, rngs), vocab_size=vocab_size, separable_head=True,
      embed_dim=cfg.embed_dim, num_layers=cfg.num_layers,
      row_parallel_per_layer=('heads', 'mlp'), flops_per_token=flops_per_token,
      context_parallel=True, untied_embeddings=not cfg.tie_embeddings,
      quantized_params=(matmul_params - vocab_size * D) if cfg.matmul.quantized else 0)
