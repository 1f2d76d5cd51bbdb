"""Multi-head latent attention (DeepSeek-V2 / V3), the Llama block's attention when
model.mla_kv_rank > 0.

Keys and values come from one low-rank latent per position: x -> [latent C | rotary key R]
(`w_kv_a`), the latent RMS-normalised and projected up to every head's key part K and value V
(`w_kv_b`). Each head's key is [its key part | the one rotary key, shared by the heads]; each
query is [K | R] with rotary positions on its last R dimensions, projected from x directly or
through a normalised low-rank latent of its own (model.mla_q_rank). Attention scales the logits
by 1 / sqrt(K + R) and the output projection reads the heads' V values.

Heads split over `tensor` as in the Llama block (the up-projections and the output projection
are column- and row-parallel in `heads`); the latent projections are whole on every device
(DeepSeek's layout too), their gradients summed over the heads' devices by the casts of
shard_map's varying types. Rotary positions pair dimensions as DeepSeek's checkpoints do
(`rope_interleave`; llama_layers.rotary).

Generation caches each position's normalised latent and rotary key (ops.latent_history), C + R
numbers per layer and position instead of the keys' and values' H (K + R + V).

Shape suffixes: B batch, L length (S: the positions the queries see), D embed, H heads, K key
part, R rotary part, V value, C kv latent, Q query latent.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from engine.models import quantized_matmul
from engine.models.attention.spec import AttentionSpec
from engine.models.layers import dense, param
from engine.models.llama.layers import RMSNorm, Rope, rotary


# DeepSeek's latent norms keep their own epsilon whatever the model's norm_eps (rms_norm_eps).
LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class LatentConfig:
  kv_rank: int  # C
  q_rank: int  # Q; 0: queries projected from x directly.
  rope_dim: int  # R
  value_dim: int  # V
  rope_interleave: bool = True


class LatentAttention(nnx.Module):

  def __init__(self, embed_dim: int, num_heads: int, head_dim: int, cfg: LatentConfig,
               init_std: float, rngs: nnx.Rngs):
    D, H, K, R, V, C = (embed_dim, num_heads, head_dim, cfg.rope_dim, cfg.value_dim,
                        cfg.kv_rank)
    self.cfg = cfg
    if cfg.q_rank:
      self.w_q_a_DQ = param(rngs, (D, cfg.q_rank), ('embed', 'latent'), init_std)
      self.q_a_norm = RMSNorm(cfg.q_rank, LATENT_NORM_EPS, rngs)
      self.w_q_b_QHK = param(rngs, (cfg.q_rank, H, K + R), ('latent', 'heads', 'head_dim'),
                             init_std)
    else:
      self.w_q_DHK = param(rngs, (D, H, K + R), ('embed', 'heads', 'head_dim'), init_std)
    self.w_kv_a_DC = param(rngs, (D, C + R), ('embed', 'latent'), init_std)
    self.kv_a_norm = RMSNorm(C, LATENT_NORM_EPS, rngs)
    self.w_kv_b_CHK = param(rngs, (C, H, K + V), ('latent', 'heads', 'head_dim'), init_std)
    self.w_o_HVD = param(rngs, (H, V, D), ('heads', 'head_dim', 'embed'), init_std)

  def __call__(self, x_BLD, ops, rope: Rope, precision: quantized_matmul.MatmulPrecision,
               attention: AttentionSpec):
    cfg, R = self.cfg, self.cfg.rope_dim
    positions_L = ops.positions(x_BLD.shape[1])
    turn = lambda x: rotary(x, positions_L, rope, cfg.rope_interleave)
    x_BLD = ops.column_parallel_input(x_BLD, 'heads')  # Feeds the q and kv projections.
    project = lambda x, w: dense(x, w, precision=precision)
    if cfg.q_rank:
      q_BLHK = project(self.q_a_norm(project(x_BLD, self.w_q_a_DQ[...])), self.w_q_b_QHK[...])
    else:
      q_BLHK = project(x_BLD, self.w_q_DHK[...])
    q_BLHK = jnp.concatenate([q_BLHK[..., :-R], turn(q_BLHK[..., -R:])], axis=-1)
    compressed_BLC = project(x_BLD, self.w_kv_a_DC[...])
    key_rope_BLR = turn(compressed_BLC[..., None, cfg.kv_rank:])[..., 0, :]
    # The keys and values of every position the queries see (generation: from its cache).
    latent_BLC = self.kv_a_norm(compressed_BLC[..., :cfg.kv_rank])
    latent_BSC, key_rope_BSR = ops.latent_history(latent_BLC, key_rope_BLR)
    kv_BSHK = project(latent_BSC, self.w_kv_b_CHK[...])
    K = kv_BSHK.shape[-1] - cfg.value_dim
    k_BSHK = jnp.concatenate(  # One rotary key for every head.
        [kv_BSHK[..., :K], jnp.broadcast_to(key_rope_BSR[..., None, :], (*kv_BSHK.shape[:3], R))],
        axis=-1)
    heads = ('batch', 'length', 'heads', 'head_dim')
    q_BLHK, k_BSHK = ops.constrain(q_BLHK, heads), ops.constrain(k_BSHK, heads)
    v_BSHV = ops.constrain(kv_BSHK[..., K:], heads)
    # The scale of the query-key head size (K + R), not the value's: the spec's default.
    out_BLHV = ops.attention(q_BLHK, k_BSHK, v_BSHV,
                             dataclasses.replace(attention, scale=None, softcap=None, window=None))
    y_BLD = dense(out_BLHV, self.w_o_HVD[...], in_dims=2, precision=precision)
    return ops.finish_contraction(y_BLD, 'heads')
