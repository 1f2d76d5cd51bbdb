"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`) checkpoints,
computed by the engine's Llama (engine/models/llama/model.py) with Gemma's options: a norm after
each sublayer too (model.post_norms), GeGLU (model.mlp_activation=gelu_tanh), the embedding scaled
by sqrt(hidden) (model.embed_scale), `query_pre_attn_scalar` as the attention scale, the soft
caps on the attention's and the output's logits (Gemma 2), q / k norms (Gemma 3), and every n-th
layer global, the others local with their own rotary base (model.global_every,
model.rope_local_base).

  model.embed_tokens.weight                  [V, D]   tok_embed_VD            [V, D]
  model.layers.{i}.input_layernorm           [D]      blocks/attn_norm        (1 + w)
  model.layers.{i}.self_attn.{q,k,v,o}_proj           as the Llama family's
    (Gemma 3: q_norm / k_norm .weight [K]    blocks/q_norm, k_norm   (1 + w))
  model.layers.{i}.post_attention_layernorm  [D]      blocks/attn_out_norm    (1 + w)
  model.layers.{i}.pre_feedforward_layernorm [D]      blocks/mlp_norm         (1 + w)
  model.layers.{i}.mlp.{gate,up,down}_proj            as the Llama family's
  model.layers.{i}.post_feedforward_layernorm [D]     blocks/mlp_out_norm     (1 + w)
  model.norm.weight                          [D]      final_norm              (1 + w)
  lm_head.weight (or the embedding, tied)    [V, D]   head_DV                 [D, V]

Gemma's RMSNorm multiplies by 1 + w (in float32), the engine's by its scale: the `plus_one`
layout adds one on loading and subtracts it on saving. Gemma's `post_attention_layernorm` is the
attention's output norm, where the Llama family's tensor of that name is the MLP's input norm.
The checkpoints tie the output head to the embedding; the engine loads the head from it and
trains the two apart (config.json written with tie_word_embeddings false). Local layers attend
within `sliding_window` (model.sliding_window: the einsum attention and generation compute it),
global layers to every key before them.
"""

from __future__ import annotations

import math

from engine.models.formats import llama as llama_hf
from engine.models.formats.interface import HFFormat, HFTensor, UnsupportedCheckpoint

_LAYER = 'model.layers.{i}.'
_NORMS = (
    HFTensor('blocks/attn_norm/scale', _LAYER + 'input_layernorm.weight', 'plus_one'),
    HFTensor('blocks/q_norm/scale', _LAYER + 'self_attn.q_norm.weight', 'plus_one'),
    HFTensor('blocks/k_norm/scale', _LAYER + 'self_attn.k_norm.weight', 'plus_one'),
    HFTensor('blocks/attn_out_norm/scale', _LAYER + 'post_attention_layernorm.weight',
             'plus_one'),
    HFTensor('blocks/mlp_norm/scale', _LAYER + 'pre_feedforward_layernorm.weight', 'plus_one'),
    HFTensor('blocks/mlp_out_norm/scale', _LAYER + 'post_feedforward_layernorm.weight',
             'plus_one'),
    HFTensor('final_norm/scale', 'model.norm.weight', 'plus_one'),
)
# The Llama family's projections, embedding and head; Gemma's norms.
TENSORS = tuple(t for t in llama_hf.TENSORS if not t.path.endswith('/scale')
                and not t.path.startswith('blocks/b_')) + _NORMS

GELU_TANH = ('gelu_pytorch_tanh', 'gelu_new')  # transformers' names of tanh-approximated GELU.
GLOBAL, LOCAL = 'full_attention', 'sliding_attention'


def _global_every(hf: dict, where: str, default_pattern: int) -> int:
  """model.global_every of config.json's `layer_types` (older files: every
  `sliding_window_pattern`-th layer global); 0 when every layer is global, more than the layers
  when none is."""
  layers = hf['num_hidden_layers']
  types = hf.get('layer_types')
  if types is None:
    n = int(hf.get('sliding_window_pattern') or default_pattern)
    types = [GLOBAL if (i + 1) % n == 0 else LOCAL for i in range(layers)]
  if all(t == GLOBAL for t in types):
    return 0
  if all(t == LOCAL for t in types):  # A stack shorter than the pattern (a small test model).
    return len(types) + 1
  n = types.index(GLOBAL) + 1 if GLOBAL in types else 0
  if not n or types != [GLOBAL if (i + 1) % n == 0 else LOCAL for i in range(len(types))]:
    raise UnsupportedCheckpoint(
        f'{where}: layer_types {types} is not every n-th layer global and the others local; '
        'the engine computes that pattern only (model.global_every).')
  return n


def _gemma(hf: dict, where: str, architecture: str, default_pattern: int) -> dict:
  activation = hf.get('hidden_activation') or hf.get('hidden_act') or 'gelu_pytorch_tanh'
  if activation not in GELU_TANH:
    raise UnsupportedCheckpoint(f'{where}: hidden_activation={activation!r} is not supported '
                                "(the engine's Gemma MLP is GeGLU with tanh-approximated GELU).")
  llama_hf.no_attention_bias(hf, where)
  if hf.get('use_bidirectional_attention'):
    raise UnsupportedCheckpoint(f'{where}: use_bidirectional_attention=true is not supported '
                                '(the engine attends causally).')
  rope, local = _rope_by_layer_type(hf, where)
  plain = {key: value for key, value in hf.items() if key not in ('hidden_act', 'rope_scaling',
                                                                   'rope_parameters')}
  settings = llama_hf.common({**plain, 'rope_parameters': rope}, where, architecture)
  every = _global_every(hf, where, default_pattern)
  settings.update(
      post_norms=True, mlp_activation='gelu_tanh', embed_scale=True, global_every=every,
      attention_scale=float(hf.get('query_pre_attn_scalar') or settings['head_dim']) ** -0.5,
      attention_softcap=float(hf.get('attn_logit_softcapping') or 0.0),
      logit_softcap=float(hf.get('final_logit_softcapping') or 0.0))
  if not every:
    settings['sliding_window'] = 0  # No layer is local.
  if local is not None and every:
    settings['rope_local_base'] = local
  return settings


def _rope_by_layer_type(hf: dict, where: str) -> tuple[dict, float | None]:
  """(the global layers' rotary settings in transformers 5's form, the local layers' base or
  None: the same as the global ones'). Gemma 3's rope_parameters are by layer type (older files:
  rope_theta and rope_scaling for the global layers, rope_local_base_freq for the local ones)."""
  params = hf.get('rope_parameters')
  if params and GLOBAL in params:
    local = dict(params.get(LOCAL) or {'rope_type': 'default', 'rope_theta': 10_000.0})
    if local.get('rope_type', 'default') != 'default':
      raise UnsupportedCheckpoint(
          f"{where}: rope_parameters.{LOCAL}.rope_type={local['rope_type']!r} is not supported "
          '(the engine rotates local layers with the default frequencies of their own base).')
    return dict(params[GLOBAL]), float(local.get('rope_theta', 10_000.0))
  if params:
    return dict(params), None
  rope = dict(hf.get('rope_scaling') or {'rope_type': 'default'})
  rope.setdefault('rope_type', rope.pop('type', 'default'))
  rope['rope_theta'] = float(hf.get('rope_theta', 10_000.0))
  local = hf.get('rope_local_base_freq')
  return rope, None if local is None else float(local)


def _gemma2(hf: dict, where: str) -> dict:
  settings = _gemma(hf, where, 'Gemma2ForCausalLM', 2)
  if settings.get('rope_local_base'):
    raise UnsupportedCheckpoint(f'{where}: a rotary base by layer type is not Gemma 2\'s.')
  return settings


def _gemma3(hf: dict, where: str) -> dict:
  return {**_gemma(hf, where, 'Gemma3ForCausalLM', 6), 'qk_norm': True}


def _to_hf_config(architecture: str, model_type: str):
  def to_hf_config(model_config, vocab_size: int) -> dict:
    """config.json for a Gemma `model`: the Llama family's sizes and rotary, Gemma's options."""
    config = llama_hf.to_hf_config(architecture, model_type)(model_config, vocab_size)
    for key in ('hidden_act', 'mlp_bias', 'use_sliding_window'):
      config.pop(key, None)
    scale = (model_config.attention_scale if model_config.attention_scale != -1
             else config['head_dim'] ** -0.5)
    scalar = scale ** -2
    layers, every = model_config.num_layers, model_config.global_every
    types = [GLOBAL if not every or (i + 1) % every == 0 else LOCAL for i in range(layers)]
    # A local layer without a window sees every position the config allows.
    window = model_config.sliding_window or (model_config.max_len if every else None)
    config.update(
        hidden_activation='gelu_pytorch_tanh', attention_bias=False,
        query_pre_attn_scalar=round(scalar) if math.isclose(scalar, round(scalar)) else scalar,
        attn_logit_softcapping=model_config.attention_softcap or None,
        final_logit_softcapping=model_config.logit_softcap or None,
        sliding_window=window, layer_types=types)
    if model_type == 'gemma3_text':
      local = model_config.rope_local_base or model_config.rope_base
      config['rope_parameters'] = {GLOBAL: config['rope_parameters'],
                                   LOCAL: {'rope_type': 'default', 'rope_theta': local}}
      config['rope_local_base_freq'] = local
    return config
  return to_hf_config


def _unwritable(architecture: str, gemma3: bool):
  def why(model) -> str:
    """What of the model `architecture` cannot write ('' if nothing)."""
    reasons = [
        (model.get('mla_kv_rank', 0), f'model.mla_kv_rank={model.get("mla_kv_rank", 0)} '
         f'({architecture} has no latent attention)'),
        (not model.get('post_norms', False), f'model.post_norms=False ({architecture} '
         'normalises each sublayer\'s output)'),
        (model.get('mlp_activation', 'silu') != 'gelu_tanh', 'model.mlp_activation='
         f"{model.get('mlp_activation', 'silu')!r} ({architecture}'s MLP is GeGLU: gelu_tanh)"),
        (not model.get('embed_scale', False), f'model.embed_scale=False ({architecture} scales '
         'the embedding by sqrt(hidden))'),
        (model.qkv_bias, f'model.qkv_bias=True ({architecture} has no q/k/v biases)'),
        (bool(model.qk_norm) != gemma3, f'model.qk_norm={bool(model.qk_norm)} ({architecture} '
         f'{"normalises" if gemma3 else "does not normalise"} each query and key head)'),
        (not gemma3 and model.get('rope_local_base', 0.0), 'model.rope_local_base='
         f"{model.get('rope_local_base', 0.0)} ({architecture} rotates every layer alike)")]
    return next((str(why) for refused, why in reasons if refused), '')
  return why


FORMATS = (
    HFFormat('Gemma2ForCausalLM', 'llama', TENSORS, _gemma2,
             _to_hf_config('Gemma2ForCausalLM', 'gemma2'),
             unwritable=_unwritable('Gemma2ForCausalLM', False)),
    HFFormat('Gemma3ForCausalLM', 'llama', TENSORS, _gemma3,
             _to_hf_config('Gemma3ForCausalLM', 'gemma3_text'),
             unwritable=_unwritable('Gemma3ForCausalLM', True)),
)
