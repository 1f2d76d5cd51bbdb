"""Llama's Hugging Face checkpoints (`LlamaForCausalLM`): tensor names, layouts, config keys.

  model.embed_tokens.weight              [V, D]     tok_embed_VD              [V, D]
  model.layers.{i}.input_layernorm       [D]        blocks/attn_norm/scale    [L, D]
  model.layers.{i}.self_attn.q_proj      [H K, D]   blocks/w_q_DHK            [L, D, H, K]
  model.layers.{i}.self_attn.k_proj      [N K, D]   blocks/w_k_DNK            [L, D, N, K]
  model.layers.{i}.self_attn.v_proj      [N K, D]   blocks/w_v_DNK            [L, D, N, K]
  model.layers.{i}.self_attn.o_proj      [D, H K]   blocks/w_o_HKD            [L, H, K, D]
  model.layers.{i}.post_attention_layernorm [D]     blocks/mlp_norm/scale     [L, D]
  model.layers.{i}.mlp.gate_proj         [F, D]     blocks/w_gate_DF          [L, D, F]
  model.layers.{i}.mlp.up_proj           [F, D]     blocks/w_up_DF            [L, D, F]
  model.layers.{i}.mlp.down_proj         [D, F]     blocks/w_down_FD          [L, F, D]
  model.norm.weight                      [D]        final_norm/scale          [D]
  lm_head.weight (or the embedding, tied) [V, D]    head_DV                   [D, V]

The rotary convention is the same (rotate-half, as Hugging Face's Llama stores q and k), so no
weight is permuted.
"""

from __future__ import annotations

from engine.models.hf_format import HFFormat, HFTensor, UnsupportedCheckpoint

TENSORS = (
    HFTensor('tok_embed_VD', 'model.embed_tokens.weight', 'same'),
    HFTensor('blocks/attn_norm/scale', 'model.layers.{i}.input_layernorm.weight', 'same'),
    HFTensor('blocks/w_q_DHK', 'model.layers.{i}.self_attn.q_proj.weight', 'heads_out'),
    HFTensor('blocks/w_k_DNK', 'model.layers.{i}.self_attn.k_proj.weight', 'heads_out'),
    HFTensor('blocks/w_v_DNK', 'model.layers.{i}.self_attn.v_proj.weight', 'heads_out'),
    HFTensor('blocks/w_o_HKD', 'model.layers.{i}.self_attn.o_proj.weight', 'heads_in'),
    HFTensor('blocks/mlp_norm/scale', 'model.layers.{i}.post_attention_layernorm.weight', 'same'),
    HFTensor('blocks/w_gate_DF', 'model.layers.{i}.mlp.gate_proj.weight', 'linear'),
    HFTensor('blocks/w_up_DF', 'model.layers.{i}.mlp.up_proj.weight', 'linear'),
    HFTensor('blocks/w_down_FD', 'model.layers.{i}.mlp.down_proj.weight', 'linear'),
    HFTensor('final_norm/scale', 'model.norm.weight', 'same'),
    HFTensor('head_DV', 'lm_head.weight', 'linear', tied_to='model.embed_tokens.weight'),
)


def to_model_config(hf: dict, where: str) -> dict:
  """The engine's `model` settings for a Hugging Face Llama config; an error for anything
  the engine's Llama does not compute the same way (UnsupportedCheckpoint)."""
  heads, width = hf['num_attention_heads'], hf['hidden_size']
  unsupported = {
      'rope_scaling': hf.get('rope_scaling') not in (None, {}),
      'attention_bias': bool(hf.get('attention_bias')),
      'mlp_bias': bool(hf.get('mlp_bias')),
      f'hidden_act={hf.get("hidden_act")!r}': hf.get('hidden_act', 'silu') != 'silu',
      'head_dim != hidden_size / num_attention_heads':
          hf.get('head_dim', width // heads) * heads != width,
  }
  found = [name for name, bad in unsupported.items() if bad]
  if found:
    raise UnsupportedCheckpoint(f'{where}: {", ".join(found)} is not supported by the engine\'s Llama '
                      '(no rotary scaling, no biases, SiLU, head_dim = width / heads).')
  return {'name': 'llama', 'num_layers': hf['num_hidden_layers'], 'embed_dim': width,
          'num_heads': heads, 'num_kv_heads': hf.get('num_key_value_heads', heads),
          'mlp_dim': hf['intermediate_size'], 'vocab_size': hf['vocab_size'],
          'rope_base': float(hf.get('rope_theta', 10_000.0)),
          'norm_eps': float(hf.get('rms_norm_eps', 1e-6))}


def to_hf_config(model_config, vocab_size: int) -> dict:
  """config.json for the engine's Llama `model` settings."""
  heads = model_config.num_heads
  return {
      'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
      'hidden_size': model_config.embed_dim, 'intermediate_size': model_config.mlp_dim,
      'num_hidden_layers': model_config.num_layers, 'num_attention_heads': heads,
      'num_key_value_heads': model_config.num_kv_heads if model_config.num_kv_heads > 0 else heads,
      'head_dim': model_config.embed_dim // heads, 'vocab_size': vocab_size,
      'rope_theta': model_config.rope_base, 'rms_norm_eps': model_config.norm_eps,
      'max_position_embeddings': model_config.max_len, 'hidden_act': 'silu',
      'tie_word_embeddings': False, 'attention_bias': False, 'mlp_bias': False,
      'rope_scaling': None, 'torch_dtype': 'float32'}


FORMAT = HFFormat('LlamaForCausalLM', TENSORS, to_model_config, to_hf_config)
