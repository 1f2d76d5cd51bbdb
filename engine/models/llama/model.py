"""A Llama-style decoder in Flax NNX: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Pre-norm blocks without biases; rotary position embeddings on queries and keys (the rotate-half
convention of Llama's Hugging Face checkpoints, base `rope_base`); a SwiGLU MLP; `num_kv_heads`
key/value heads shared by groups of query heads; an untied output projection. Blocks are stacked
along the `layers` axis and applied with `nnx.scan`, like GPT's, and use the same logical names,
so every rule preset and both modes work unchanged. Key/value heads carry their own logical name,
`kv_heads`: the rules split them over `tensor` where they divide and replicate them otherwise
(`ModelSpec.split_where_divisible`). A block's MLP may be a mixture of experts
(engine/models/moe/layer.py), after `dense_layers` dense ones that run before the stack
(`dense_blocks`, DeepSeek-V3's first_k_dense_replace), and its attention DeepSeek's multi-head
latent attention (engine/models/llama/latent_attention.py). Gemma's options
(engine/models/formats/gemma.py) add a norm after each sublayer, GeGLU, a scaled embedding, soft
caps on the attention's and the output's logits, and local layers among global ones with their own
rotary base and sliding window: each layer of the stack reads its number from the carry to choose
them. The keys only this family reads, and their checks, are in engine/models/llama/config.py; the
registry entry that reads them into a LlamaConfig, engine/models/llama/spec.py.

Shape suffixes: B batch, L length, D embed, H query heads, N key/value heads (n: those this
device's query heads read, ops.kv_for_query_heads), K head_dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models import quantized_matmul
from engine.models.llama import lora
from engine.models.llama.lora import LoraConfig
from engine.models.attention.spec import AttentionSpec, soft_cap
from engine.models.llama.latent_attention import LatentAttention, LatentConfig
from engine.models.layers import FIRST_LAYERS, apply_layers, dense, one_layer, param, stack_layers
from engine.models.llama.layers import RMSNorm, Rope, rotary
from engine.models.moe.layer import MoeConfig, MoeMlp
from engine.models.ops import LocalOps
from engine.models.quantized_matmul import MatmulPrecision


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  embed_dim: int
  mlp_dim: int
  head_dim: int
  rope: Rope = Rope()
  norm_eps: float = 1e-5
  # Every layer's attention: its path, scale, soft cap (Gemma 2) and sliding window (Mistral;
  # with global_every, the local layers' only: Block._attention_spec).
  attention: AttentionSpec = AttentionSpec()
  qkv_bias: bool = False  # Qwen2.
  qk_norm: bool = False  # Qwen3: RMSNorm over each query / key head, before rotary.
  scan_layers: bool = True
  init_std: float = 0.02
  moe: MoeConfig | None = None  # A mixture of experts in place of each block's MLP.
  matmul: MatmulPrecision = quantized_matmul.DEFAULT  # The projections' (not the head's).
  latent: LatentConfig | None = None  # Multi-head latent attention in place of the attention.
  # With `moe`: the first this many layers keep the dense MLP (DeepSeek-V3), the rest are stacked.
  dense_layers: int = 0
  lora: LoraConfig | None = None  # Low-rank adapters on the targeted projections.
  # Gemma 2 / 3 (engine/models/formats/gemma.py): each sublayer's output normalised before its
  # residual add; GeGLU ('gelu_tanh'); the embedding scaled by sqrt(embed_dim); the attention's and
  # the output's logits capped softly (soft_cap); every `global_every`-th layer global, the
  # others local, rotating by `local_rope` (None: `rope` in every layer).
  post_norms: bool = False
  mlp_activation: str = 'silu'  # llama_config.MLP_ACTIVATIONS
  embed_scale: bool = False
  logit_softcap: float | None = None
  global_every: int = 0
  local_rope: Rope | None = None


class Block(nnx.Module):
  """Pre-norm block. Query / key / value and the MLP's gate and up projections are
  column-parallel; the attention output and MLP down projections are row-parallel, each followed
  by `ops.finish_contraction`."""

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    D, H, K, F = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    self.cfg = cfg
    self.attn_norm = RMSNorm(D, cfg.norm_eps, rngs)
    self.mlp_norm = RMSNorm(D, cfg.norm_eps, rngs)
    if cfg.post_norms:
      self.attn_out_norm = RMSNorm(D, cfg.norm_eps, rngs)
      self.mlp_out_norm = RMSNorm(D, cfg.norm_eps, rngs)
    if cfg.latent:
      self.mla = LatentAttention(D, H, K, cfg.latent, cfg.init_std, rngs)
    else:
      self._init_attention(cfg, rngs)
    if cfg.moe:
      self.moe = MoeMlp(D, cfg.moe, cfg.init_std, rngs)
      return
    self.w_gate_DF = param(rngs, (D, F), ('embed', 'mlp'), cfg.init_std)
    self.w_up_DF = param(rngs, (D, F), ('embed', 'mlp'), cfg.init_std)
    self.w_down_FD = param(rngs, (F, D), ('mlp', 'embed'), cfg.init_std)
    if cfg.lora:
      lora.add_adapters(self, cfg.lora, rngs)

  def _init_attention(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    D, H, N, K = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.w_q_DHK = param(rngs, (D, H, K), ('embed', 'heads', 'head_dim'), cfg.init_std)
    self.w_k_DNK = param(rngs, (D, N, K), ('embed', 'kv_heads', 'head_dim'), cfg.init_std)
    self.w_v_DNK = param(rngs, (D, N, K), ('embed', 'kv_heads', 'head_dim'), cfg.init_std)
    if cfg.qkv_bias:
      self.b_q_HK = param(rngs, (H, K), ('heads', 'head_dim'), 0)
      self.b_k_NK = param(rngs, (N, K), ('kv_heads', 'head_dim'), 0)
      self.b_v_NK = param(rngs, (N, K), ('kv_heads', 'head_dim'), 0)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(K, cfg.norm_eps, rngs)
      self.k_norm = RMSNorm(K, cfg.norm_eps, rngs)
    self.w_o_HKD = param(rngs, (H, K, D), ('heads', 'head_dim', 'embed'), cfg.init_std)
    if cfg.lora:
      lora.add_adapters(self, cfg.lora, rngs)

  def attention(self, x_BLD, ops, layer=None):
    """`layer`: this layer's number in the stack (traced; counted by the carry where the layers
    differ: model.global_every), or None."""
    cfg = self.cfg
    if cfg.latent:
      return self.mla(x_BLD, ops, cfg.rope, cfg.matmul, cfg.attention)
    heads = ('batch', 'length', 'heads', 'head_dim')
    positions_L = ops.positions(x_BLD.shape[1])
    x_BLD = ops.column_parallel_input(x_BLD, 'heads')  # Feeds the q, k and v projections.
    q_BLHK, k_BLNK, v_BLNK = self.projections(x_BLD)
    inverse = self._inverse_frequency(layer)
    q_BLHK = ops.constrain(rotary(q_BLHK, positions_L, cfg.rope, inverse_frequency=inverse),
                           heads)
    k_BLNK = rotary(k_BLNK, positions_L, cfg.rope, inverse_frequency=inverse)
    # The key / value heads this device's query heads read, not repeated per query head: the
    # attention groups the query heads over them (ring attention passes only these around).
    k_BLnK = ops.kv_for_query_heads(k_BLNK, cfg.num_heads)
    v_BLnK = ops.kv_for_query_heads(v_BLNK, cfg.num_heads)
    out_BLHK = ops.attention(q_BLHK, k_BLnK, v_BLnK, self._attention_spec(layer))
    y_BLD = self._project('w_o_HKD', out_BLHK)
    return ops.finish_contraction(y_BLD, 'heads')

  def _attention_spec(self, layer):
    """Layer `layer`'s attention: cfg.attention, whose window (with cfg.global_every) binds on
    the local layers only: on the global ones it is the int32 maximum."""
    spec = self.cfg.attention
    if spec.window is None or not self.cfg.global_every:
      return spec
    return dataclasses.replace(
        spec, window=jnp.where(self._local(layer), spec.window, jnp.iinfo(jnp.int32).max))

  def _inverse_frequency(self, layer):
    """The rotary frequencies of layer `layer` (Gemma 3: a local layer's base is not the global
    layers'), or None: cfg.rope's, the same in every layer."""
    cfg = self.cfg
    if cfg.local_rope is None:
      return None
    return jnp.where(self._local(layer), cfg.local_rope.inverse_frequencies(cfg.head_dim),
                     cfg.rope.inverse_frequencies(cfg.head_dim))

  def _local(self, layer):
    """Whether layer `layer` (traced) is local under cfg.global_every: all but every n-th."""
    return (layer + 1) % self.cfg.global_every != 0

  def _project(self, weight: str, x):
    """x times a projection's weight (and its low-rank adapters', with LoRA)."""
    return lora.project(self, weight, x, self.cfg.lora, self.cfg.matmul)

  def projections(self, x_BLD):
    """Queries, keys and values before rotary: biased (Qwen2), each head normalised (Qwen3)."""
    q_BLHK = self._project('w_q_DHK', x_BLD)
    k_BLNK = self._project('w_k_DNK', x_BLD)
    v_BLNK = self._project('w_v_DNK', x_BLD)
    if self.cfg.qkv_bias:
      q_BLHK = q_BLHK + self.b_q_HK[...].astype(q_BLHK.dtype)
      k_BLNK = k_BLNK + self.b_k_NK[...].astype(k_BLNK.dtype)
      v_BLNK = v_BLNK + self.b_v_NK[...].astype(v_BLNK.dtype)
    if self.cfg.qk_norm:
      q_BLHK, k_BLNK = self.q_norm(q_BLHK), self.k_norm(k_BLNK)
    return q_BLHK, k_BLNK, v_BLNK

  def mlp(self, x_BLD, ops):
    x_BLD = ops.column_parallel_input(x_BLD, 'mlp')  # Feeds the gate and up projections.
    gate_BLF = self._project('w_gate_DF', x_BLD)
    up_BLF = self._project('w_up_DF', x_BLD)
    activation = (jax.nn.silu if self.cfg.mlp_activation == 'silu' else
                  lambda x: jax.nn.gelu(x, approximate=True))
    h_BLF = ops.constrain(activation(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'))
    y_BLD = self._project('w_down_FD', h_BLF)
    return ops.finish_contraction(y_BLD, 'mlp')

  def __call__(self, carry, ops):
    """x [B, L, D] -> x; or, for the training loss, (x, {'loss': auxiliary loss so far, and the
    router statistics summed so far}) -> the same with this block's mixture of experts' added;
    or, where the layers differ (local and global), (x, {'layer': this layer's number}) -> (x,
    the next's)."""
    x_BLD, aux = carry if isinstance(carry, tuple) else (carry, None)
    y_BLD = self.attention(self.attn_norm(x_BLD), ops, None if aux is None else aux['layer'])
    if self.cfg.post_norms:
      y_BLD = self.attn_out_norm(y_BLD)
    x_BLD = ops.constrain(x_BLD + y_BLD, ('batch', 'length', 'embed'))
    if self.cfg.moe:
      y_BLD, layer_loss, stats = self.moe(self.mlp_norm(x_BLD), ops)
      aux = aux if aux is None else _add_layer(aux, layer_loss, stats)
    else:
      y_BLD = self.mlp(self.mlp_norm(x_BLD), ops)
      aux = aux if aux is None else {**aux, 'layer': aux['layer'] + 1}
    if self.cfg.post_norms:
      y_BLD = self.mlp_out_norm(y_BLD)
    x_BLD = ops.constrain(x_BLD + y_BLD, ('batch', 'length', 'embed'))
    return x_BLD if aux is None else (x_BLD, aux)


def _add_layer(aux: dict, layer_loss, stats: dict) -> dict:
  """The carry's running sums with one MoE layer's loss and statistics added; its load [E]
  goes to row aux['layer'] (the layers so far: the carry counts them, so a pipeline stage
  needs no index of its own) of the [layers, E] load."""
  sums = {name: aux[name] + value for name, value in stats.items() if name != 'load'}
  row = aux['layer']
  return {**sums, 'loss': aux['loss'] + layer_loss, 'layer': row + 1,
          'load': aux['load'].at[row].add(stats['load'])}


class Llama(nnx.Module):

  def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    V, D = cfg.vocab_size, cfg.embed_dim
    self.tok_embed_VD = param(rngs, (V, D), ('vocab', 'embed'), cfg.init_std)

    if cfg.dense_layers:  # Before the stack and outside it: pipeline stages split the stack.
      dense_cfg = dataclasses.replace(cfg, moe=None)
      self.dense_blocks = stack_layers(lambda rngs: Block(dense_cfg, rngs), cfg.dense_layers,
                                       rngs, axis=FIRST_LAYERS)
    self.blocks = stack_layers(lambda rngs: Block(cfg, rngs), cfg.num_layers - cfg.dense_layers,
                               rngs)
    self.final_norm = RMSNorm(D, cfg.norm_eps, rngs)
    self.head_DV = param(rngs, (D, V), ('embed', 'vocab'), cfg.init_std)

  def __call__(self, tokens_BL: jax.Array, ops=LocalOps()) -> jax.Array:
    """Logits (float32) for every position of `tokens_BL`."""
    return self.logits_and_aux_loss(tokens_BL, ops, with_aux=False)[0]

  def logits_and_aux_loss(self, tokens_BL: jax.Array, ops=LocalOps(), with_aux: bool = True):
    """(logits, the mixture-of-experts layers' auxiliary losses summed, to add to the training
    loss: 0.0 for a dense model)."""
    logits_BLV, aux, _ = self.logits_aux_loss_and_stats(tokens_BL, ops, with_aux)
    return logits_BLV, aux

  def logits_aux_loss_and_stats(self, tokens_BL: jax.Array, ops=LocalOps(),
                                with_aux: bool = True):
    """(logits, auxiliary loss, router statistics): MoeMlp's balance and z-losses and dropped
    fraction averaged over the layers, its load per layer [layers, E] ({} for a dense model, or
    without `with_aux`)."""
    x_BLD, aux, stats = self.features_aux_loss_and_stats(tokens_BL, ops, with_aux)
    return self.head_logits(x_BLD, ops), aux, stats

  def features_aux_loss_and_stats(self, tokens_BL: jax.Array, ops=LocalOps(),
                                  with_aux: bool = True):
    """logits_aux_loss_and_stats before the head: the normalised features [B, L, D] that
    `head_logits` projects (a chunked loss projects them a slice at a time)."""
    x_BLD = ops.embed_lookup(self.tok_embed_VD[...], tokens_BL)
    if self.cfg.embed_scale:  # Gemma: sqrt(D) rounded to the embedding's dtype first.
      x_BLD = x_BLD * jnp.asarray(self.cfg.embed_dim ** 0.5, x_BLD.dtype)
    x_BLD = ops.constrain(x_BLD, ('batch', 'length', 'embed'))
    # The dense first layers one by one in Python: generation's cache must not leave a scan.
    for index in range(self.cfg.dense_layers):
      x_BLD = one_layer(self.dense_blocks, index, FIRST_LAYERS)(x_BLD, ops)
    unroll = 1 if self.cfg.scan_layers else self.cfg.num_layers - self.cfg.dense_layers
    aux, stats = 0.0, {}
    if with_aux and self.cfg.moe:  # The loss and statistics ride along the layers' carry.
      L, E = self.cfg.num_layers - self.cfg.dense_layers, self.cfg.moe.num_experts
      zero = jnp.zeros((), jnp.float32)
      carry = {'loss': zero, 'balance': zero, 'z': zero, 'dropped': zero,
               'layer': jnp.zeros((), jnp.int32), 'load': jnp.zeros((L, E), jnp.float32)}
      x_BLD, sums = apply_layers(self.blocks, (x_BLD, carry), ops, unroll)
      aux, load_LE = sums['loss'], sums['load']
      stats = {name: sums[name] / L for name in ('balance', 'z', 'dropped')}
      stats['load'] = load_LE
    elif self.cfg.global_every:  # Each layer reads its number from the carry.
      x_BLD, _ = apply_layers(self.blocks, (x_BLD, {'layer': jnp.zeros((), jnp.int32)}), ops,
                              unroll)
    else:
      x_BLD = apply_layers(self.blocks, x_BLD, ops, unroll)
    return self.final_norm(x_BLD), aux, stats

  def head_logits(self, x_BLD: jax.Array, ops=LocalOps()) -> jax.Array:
    """Logits of normalised features (any number of positions) in the compute dtype
    (engine/models/cross_entropy.py says why that is precise enough); float32 under a soft
    cap, whose tanh needs the precision near the cap."""
    logits_BLV = dense(x_BLD, self.head_DV[...],
                       preferred_element_type=jnp.float32 if self.cfg.logit_softcap else None)
    return ops.constrain(soft_cap(logits_BLV, self.cfg.logit_softcap),
                         ('batch', 'length', 'vocab'))
