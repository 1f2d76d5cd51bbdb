"""The Llama family's Hugging Face checkpoints: Llama 2 / 3.x (`LlamaForCausalLM`), Mistral,
Qwen2 / 2.5 and Qwen3, all computed by the engine's Llama (engine/models/llama/model.py).

  model.embed_tokens.weight              [V, D]     tok_embed_VD              [V, D]
  model.layers.{i}.input_layernorm       [D]        blocks/attn_norm/scale    [L, D]
  model.layers.{i}.self_attn.q_proj      [H K, D]   blocks/w_q_DHK            [L, D, H, K]
  model.layers.{i}.self_attn.k_proj      [N K, D]   blocks/w_k_DNK            [L, D, N, K]
  model.layers.{i}.self_attn.v_proj      [N K, D]   blocks/w_v_DNK            [L, D, N, K]
    (Qwen2: .bias [H K], [N K]          blocks/b_q_HK, b_k_NK, b_v_NK  [L, H, K], [L, N, K])
    (Qwen3: q_norm / k_norm .weight [K] blocks/q_norm/scale, k_norm/scale  [L, K])
  model.layers.{i}.self_attn.o_proj      [D, H K]   blocks/w_o_HKD            [L, H, K, D]
  model.layers.{i}.post_attention_layernorm [D]     blocks/mlp_norm/scale     [L, D]
  model.layers.{i}.mlp.gate_proj         [F, D]     blocks/w_gate_DF          [L, D, F]
  model.layers.{i}.mlp.up_proj           [F, D]     blocks/w_up_DF            [L, D, F]
  model.layers.{i}.mlp.down_proj         [D, F]     blocks/w_down_FD          [L, F, D]
  model.norm.weight                      [D]        final_norm/scale          [D]
  lm_head.weight (or the embedding, tied) [V, D]    head_DV                   [D, V]

The rotary convention is the same (rotate-half, as Hugging Face's Llama stores q and k), so no
weight is permuted. Config files are read in both formats: transformers 5's `rope_parameters`
and the older top-level `rope_theta` / `rope_scaling`. Everything that changes the numbers and the
engine does not compute is refused, naming the key.
"""

from __future__ import annotations

from engine.models.formats.interface import HFFormat, HFTensor, UnsupportedCheckpoint
from engine.models.llama.config import ROPE_TYPES

_LAYER = 'model.layers.{i}.'
TENSORS = (
    HFTensor('tok_embed_VD', 'model.embed_tokens.weight', 'same'),
    HFTensor('blocks/attn_norm/scale', _LAYER + 'input_layernorm.weight', 'same'),
    HFTensor('blocks/w_q_DHK', _LAYER + 'self_attn.q_proj.weight', 'heads_out'),
    HFTensor('blocks/w_k_DNK', _LAYER + 'self_attn.k_proj.weight', 'heads_out'),
    HFTensor('blocks/w_v_DNK', _LAYER + 'self_attn.v_proj.weight', 'heads_out'),
    HFTensor('blocks/b_q_HK', _LAYER + 'self_attn.q_proj.bias', 'heads_bias'),
    HFTensor('blocks/b_k_NK', _LAYER + 'self_attn.k_proj.bias', 'heads_bias'),
    HFTensor('blocks/b_v_NK', _LAYER + 'self_attn.v_proj.bias', 'heads_bias'),
    HFTensor('blocks/q_norm/scale', _LAYER + 'self_attn.q_norm.weight', 'same'),
    HFTensor('blocks/k_norm/scale', _LAYER + 'self_attn.k_norm.weight', 'same'),
    HFTensor('blocks/w_o_HKD', _LAYER + 'self_attn.o_proj.weight', 'heads_in'),
    HFTensor('blocks/mlp_norm/scale', _LAYER + 'post_attention_layernorm.weight', 'same'),
    HFTensor('blocks/w_gate_DF', _LAYER + 'mlp.gate_proj.weight', 'linear'),
    HFTensor('blocks/w_up_DF', _LAYER + 'mlp.up_proj.weight', 'linear'),
    HFTensor('blocks/w_down_FD', _LAYER + 'mlp.down_proj.weight', 'linear'),
    HFTensor('final_norm/scale', 'model.norm.weight', 'same'),
    HFTensor('head_DV', 'lm_head.weight', 'linear', tied_to='model.embed_tokens.weight'),
)
def _rope(hf: dict, where: str) -> dict:
  """The rotary settings of either config format, or an error naming the key."""
  if 'rope_parameters' in hf and hf['rope_parameters'] is not None:  # transformers >= 5
    key, params = 'rope_parameters', dict(hf['rope_parameters'])
  else:
    key, params = 'rope_scaling', dict(hf.get('rope_scaling') or {})
  if any(isinstance(value, dict) for value in params.values()):
    raise UnsupportedCheckpoint(f'{where}: {key} differs by layer type; the engine computes one '
                                'rotary embedding for every layer.')
  rope_type = params.get('rope_type', params.get('type', 'default'))
  if rope_type not in ROPE_TYPES:
    raise UnsupportedCheckpoint(f'{where}: {key}.rope_type={rope_type!r} is not implemented; the '
                                f'engine computes {", ".join(ROPE_TYPES)} rotary frequencies.')
  for name, neutral in (('partial_rotary_factor', 1.0), ('attention_factor', 1.0)):
    value = params.get(name, hf.get(name, neutral))
    if value is not None and float(value) != neutral:
      raise UnsupportedCheckpoint(f'{where}: {name}={value} is not supported (the engine rotates '
                                  'every dimension of each head and scales nothing).')
  settings = {'rope_type': rope_type,
              'rope_base': float(params.get('rope_theta', hf.get('rope_theta', 10_000.0)))}
  if rope_type in ('linear', 'llama3'):
    settings['rope_factor'] = float(params['factor'])
  if rope_type == 'llama3':
    settings.update(
        rope_low_freq_factor=float(params['low_freq_factor']),
        rope_high_freq_factor=float(params['high_freq_factor']),
        rope_original_max_len=int(params.get('original_max_position_embeddings',
                                             hf.get('max_position_embeddings', 8192))))
  return settings


# Architectures whose window covers only the layers from max_window_layers on.
_WINDOWED_FROM = ('Qwen2ForCausalLM', 'Qwen3ForCausalLM')


def _sliding_window(hf: dict, where: str, architecture: str) -> int:
  """The attention window of every layer (0: none). Mistral uses it whenever it is set; the
  Qwens only with use_sliding_window, Qwen2 / Qwen3 then on the layers from max_window_layers on
  (their `layer_types`): all of them or none, or the checkpoint is refused."""
  if 'use_sliding_window' in hf and not hf['use_sliding_window']:
    return 0
  window = int(hf.get('sliding_window') or 0)
  if not window or architecture not in _WINDOWED_FROM:
    return window
  layers, first = hf['num_hidden_layers'], hf.get('max_window_layers', 28)  # Theirs.
  types = hf.get('layer_types') or [
      'sliding_attention' if i >= first else 'full_attention' for i in range(layers)]
  if 'sliding_attention' not in types:
    return 0
  if 'full_attention' in types:
    raise UnsupportedCheckpoint(
        f'{where}: the sliding window on some layers only (layer_types, max_window_layers='
        f'{first} of {layers} layers) is not supported; the engine windows every layer alike.')
  return window


def common(hf: dict, where: str, architecture: str) -> dict:
  """What every architecture of the family shares: sizes, norms, rotary, activation (a dense
  MLP: llama_moe.py overrides the experts)."""
  heads, width = hf['num_attention_heads'], hf['hidden_size']
  if hf.get('hidden_act', 'silu') != 'silu':
    raise UnsupportedCheckpoint(f'{where}: hidden_act={hf.get("hidden_act")!r} is not supported '
                                '(the engine\'s MLP is SwiGLU, silu).')
  if hf.get('mlp_bias'):
    raise UnsupportedCheckpoint(f'{where}: mlp_bias=true is not supported (the engine\'s MLP has '
                                'no biases).')
  return {'name': 'llama', 'hf_architecture': architecture, 'num_experts': 0,
          'num_layers': hf['num_hidden_layers'], 'embed_dim': width, 'num_heads': heads,
          'num_kv_heads': hf.get('num_key_value_heads') or heads,
          'head_dim': hf.get('head_dim') or width // heads,
          'mlp_dim': hf['intermediate_size'], 'vocab_size': hf['vocab_size'],
          'max_len': int(hf.get('max_position_embeddings', 2048)),
          'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
          'sliding_window': _sliding_window(hf, where, architecture),
          **_rope(hf, where)}


def no_attention_bias(hf: dict, where: str) -> None:
  if hf.get('attention_bias'):
    raise UnsupportedCheckpoint(f'{where}: attention_bias=true is not supported (a bias on the '
                                'output projection; the engine has q/k/v biases only, as Qwen2).')


def _llama(hf: dict, where: str, architecture: str = 'LlamaForCausalLM') -> dict:
  no_attention_bias(hf, where)
  return common(hf, where, architecture)


def _qwen2(hf: dict, where: str) -> dict:
  return {**common(hf, where, 'Qwen2ForCausalLM'), 'qkv_bias': True}


def _qwen3(hf: dict, where: str) -> dict:
  no_attention_bias(hf, where)
  return {**common(hf, where, 'Qwen3ForCausalLM'), 'qk_norm': True}


def to_hf_config(architecture: str, model_type: str):
  def to_hf_config(model_config, vocab_size: int) -> dict:
    """config.json for the engine's Llama `model` settings, in transformers 5's format (plus the
    top-level rope_theta older versions read)."""
    heads = model_config.num_heads
    rope = {'rope_type': model_config.rope_type, 'rope_theta': model_config.rope_base}
    if model_config.rope_type != 'default':
      rope['factor'] = model_config.rope_factor
    if model_config.rope_type == 'llama3':
      rope.update(low_freq_factor=model_config.rope_low_freq_factor,
                  high_freq_factor=model_config.rope_high_freq_factor,
                  original_max_position_embeddings=model_config.rope_original_max_len)
    config = {
        'architectures': [architecture], 'model_type': model_type,
        'hidden_size': model_config.embed_dim, 'intermediate_size': model_config.mlp_dim,
        'num_hidden_layers': model_config.num_layers, 'num_attention_heads': heads,
        'num_key_value_heads': (model_config.num_kv_heads if model_config.num_kv_heads > 0
                                else heads),
        'head_dim': (model_config.head_dim if model_config.head_dim > 0
                     else model_config.embed_dim // heads),
        'vocab_size': vocab_size, 'rms_norm_eps': model_config.norm_eps,
        'max_position_embeddings': model_config.max_len, 'hidden_act': 'silu',
        'tie_word_embeddings': False, 'rope_parameters': rope,
        'rope_theta': model_config.rope_base, 'mlp_bias': False}
    if architecture in ('LlamaForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'):
      config['attention_bias'] = False
    window = model_config.sliding_window or None
    if architecture == 'MistralForCausalLM':
      config['sliding_window'] = window
    elif architecture in _WINDOWED_FROM:  # Windowed from layer 0 on: every layer.
      config.update(use_sliding_window=bool(window), sliding_window=window,
                    max_window_layers=0 if window else model_config.num_layers)
    elif architecture.startswith('Qwen'):
      config.update(use_sliding_window=bool(window), sliding_window=window)
    return config
  return to_hf_config


# Gemma's options (engine/models/formats/gemma.py) at the values that leave a Llama unchanged.
GEMMA_NEUTRAL = {'post_norms': False, 'mlp_activation': 'silu', 'embed_scale': False,
                 'attention_softcap': 0.0, 'logit_softcap': 0.0, 'global_every': 0,
                 'rope_local_base': 0.0}


def gemma_option(model) -> str:
  """'model.KEY=VALUE' of the first Gemma option `model` sets, or ''."""
  return next((f'model.{key}={model[key]!r}' for key, neutral in GEMMA_NEUTRAL.items()
               if model.get(key, neutral) != neutral), '')


def no_latent_attention(architecture: str):
  def why(model) -> str:
    """What of the model `architecture` cannot write ('' if nothing): latent attention, or an
    option of Gemma's."""
    if model.get('mla_kv_rank', 0):
      return f'model.mla_kv_rank={model.mla_kv_rank} ({architecture} has no latent attention)'
    if option := gemma_option(model):
      return f'{option} ({architecture} computes none of Gemma\'s options)'
    return ''
  return why


FORMATS = tuple(
    HFFormat(architecture, 'llama', TENSORS, read, to_hf_config(architecture, model_type),
             unwritable=no_latent_attention(architecture))
    for architecture, model_type, read in (
        ('LlamaForCausalLM', 'llama', _llama),
        ('MistralForCausalLM', 'mistral',
         lambda hf, where: _llama(hf, where, 'MistralForCausalLM')),
        ('Qwen2ForCausalLM', 'qwen2', _qwen2),
        ('Qwen3ForCausalLM', 'qwen3', _qwen3)))
