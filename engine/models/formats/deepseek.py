"""DeepSeek-V3's Hugging Face checkpoints (`DeepseekV3ForCausalLM`), computed by the engine's Llama
with multi-head latent attention (engine/models/llama/latent_attention.py) and a mixture of experts
with sigmoid group-limited routing, shared experts and the router bias of auxiliary-loss-free
balancing (engine/models/moe/layer.py, balance.py). Per layer i and expert e:

  self_attn.q_a_proj [Q, D], q_a_layernorm [Q],     blocks/mla/w_q_a_DQ, q_a_norm/scale,
    q_b_proj [H (K + R), Q]  (or q_proj [H (K + R), D])   w_q_b_QHK (w_q_DHK)
  self_attn.kv_a_proj_with_mqa [C + R, D]           blocks/mla/w_kv_a_DC
  self_attn.kv_a_layernorm [C]                      blocks/mla/kv_a_norm/scale
  self_attn.kv_b_proj [H (K + V), C]                blocks/mla/w_kv_b_CHK
  self_attn.o_proj [D, H V]                         blocks/mla/w_o_HVD
  mlp.gate.weight [E, D], .e_score_correction_bias  blocks/moe/w_router_DE, b_router_E
  mlp.experts.{e}.{gate,up,down}_proj               blocks/moe/w_{gate,up}_EDF, w_down_EFD
  mlp.shared_experts.{gate,up,down}_proj            blocks/moe/w_shared_{gate,up,down}_*

(the model.layers.{i}. prefix; norms, embedding and head as llama.py's). The checkpoint's
rotary dimensions are interleaved pairs (rope_interleave), which the engine's rotary takes as
they are (model.mla_rope_interleave), so no weight is permuted. An imported model balances with
the bias (model.moe_balance=aux_free), as DeepSeek-V3 trains.

The first first_k_dense_replace layers are dense (model.moe_dense_layers: dense_blocks/, with
Llama's MLP of intermediate_size), numbered before the stacked ones. Refused, naming the key: every
layer dense, yarn rotary scaling, attention biases, weights not renormalised
(norm_topk_prob=false). The multi-token-prediction layers
(num_nextn_predict_layers) are not in transformers' checkpoints and not read.
"""

from __future__ import annotations

from engine.models.formats import llama as llama_hf
from engine.models.formats.interface import HFFormat, HFTensor, UnsupportedCheckpoint

ARCHITECTURE = 'DeepseekV3ForCausalLM'
_LAYER = 'model.layers.{i}.'
_ATTN, _MLP = _LAYER + 'self_attn.', _LAYER + 'mlp.'
_LLAMA_ATTENTION_AND_MLP = ('blocks/w_', 'blocks/b_', 'blocks/q_norm', 'blocks/k_norm')

TENSORS = tuple(t for t in llama_hf.TENSORS if not t.path.startswith(_LLAMA_ATTENTION_AND_MLP)) + (
    HFTensor('blocks/mla/w_q_a_DQ', _ATTN + 'q_a_proj.weight', 'linear'),
    HFTensor('blocks/mla/q_a_norm/scale', _ATTN + 'q_a_layernorm.weight', 'same'),
    HFTensor('blocks/mla/w_q_b_QHK', _ATTN + 'q_b_proj.weight', 'heads_out'),
    HFTensor('blocks/mla/w_q_DHK', _ATTN + 'q_proj.weight', 'heads_out'),
    HFTensor('blocks/mla/w_kv_a_DC', _ATTN + 'kv_a_proj_with_mqa.weight', 'linear'),
    HFTensor('blocks/mla/kv_a_norm/scale', _ATTN + 'kv_a_layernorm.weight', 'same'),
    HFTensor('blocks/mla/w_kv_b_CHK', _ATTN + 'kv_b_proj.weight', 'heads_out'),
    HFTensor('blocks/mla/w_o_HVD', _ATTN + 'o_proj.weight', 'heads_in'),
    HFTensor('blocks/moe/w_router_DE', _MLP + 'gate.weight', 'linear'),
    HFTensor('blocks/moe/b_router_E', _MLP + 'gate.e_score_correction_bias', 'same'),
    HFTensor('blocks/moe/w_gate_EDF', _MLP + 'experts.{e}.gate_proj.weight', 'linear'),
    HFTensor('blocks/moe/w_up_EDF', _MLP + 'experts.{e}.up_proj.weight', 'linear'),
    HFTensor('blocks/moe/w_down_EFD', _MLP + 'experts.{e}.down_proj.weight', 'linear'),
    HFTensor('blocks/moe/w_shared_gate_DS', _MLP + 'shared_experts.gate_proj.weight', 'linear'),
    HFTensor('blocks/moe/w_shared_up_DS', _MLP + 'shared_experts.up_proj.weight', 'linear'),
    HFTensor('blocks/moe/w_shared_down_SD', _MLP + 'shared_experts.down_proj.weight', 'linear'),
)
_DENSE_MLP = ('blocks/w_gate_DF', 'blocks/w_up_DF', 'blocks/w_down_FD')
# The dense first layers (first_k_dense_replace): the same attention and norms, Llama's MLP.
TENSORS += tuple(
    HFTensor('dense_' + t.path, t.name, t.layout)
    for t in TENSORS + tuple(t for t in llama_hf.TENSORS if t.path in _DENSE_MLP)
    if t.path.startswith('blocks/') and not t.path.startswith('blocks/moe/'))


def _refuse(hf: dict, where: str) -> None:
  layers, dense = hf['num_hidden_layers'], hf.get('first_k_dense_replace') or 0
  if dense >= layers:
    raise UnsupportedCheckpoint(
        f'{where}: first_k_dense_replace={dense} makes all {layers} layers dense; the engine '
        'computes DeepSeek-V3 with at least one mixture-of-experts layer: load a checkpoint '
        'with first_k_dense_replace < num_hidden_layers.')
  if not hf.get('norm_topk_prob', True):
    raise UnsupportedCheckpoint(
        f'{where}: norm_topk_prob=false is not supported (the top-k scores used as they are); '
        "the engine's sigmoid_topk renormalises them: load a checkpoint with norm_topk_prob=true.")
  for key, expected in (('scoring_func', 'sigmoid'), ('topk_method', 'noaux_tc')):
    if hf.get(key, expected) != expected:
      raise UnsupportedCheckpoint(f'{where}: {key}={hf[key]!r} is not supported (the engine '
                                  f'routes as DeepSeek-V3: {key}={expected!r}).')
  llama_hf.no_attention_bias(hf, where)


def _deepseek_v3(hf: dict, where: str) -> dict:
  _refuse(hf, where)
  heads, expert_dim = hf['num_attention_heads'], hf['moe_intermediate_size']
  rotary = {k: v for k, v in hf.items() if k != 'head_dim'}  # head_dim: the rotary part's.
  return {**llama_hf.common(rotary, where, ARCHITECTURE),
          'num_kv_heads': heads, 'head_dim': hf['qk_nope_head_dim'],
          'mla_kv_rank': hf['kv_lora_rank'], 'mla_q_rank': hf.get('q_lora_rank') or 0,
          'mla_rope_dim': hf['qk_rope_head_dim'], 'mla_value_dim': hf['v_head_dim'],
          'mla_rope_interleave': bool(hf.get('rope_interleave', True)),
          'num_experts': hf['n_routed_experts'], 'experts_per_token': hf['num_experts_per_tok'],
          'moe_router': 'sigmoid_topk', 'moe_groups': hf.get('n_group') or 1,
          'moe_topk_groups': hf.get('topk_group') or 1,
          'moe_routed_scale': float(hf.get('routed_scaling_factor', 1.0)),
          'moe_mlp_dim': expert_dim, 'moe_shared_expert': expert_dim * (hf.get('n_shared_experts')
                                                                         or 0),
          'moe_dense_layers': hf.get('first_k_dense_replace') or 0,
          'moe_dispatch': 'dropless', 'moe_balance': 'aux_free'}


def _to_hf_config(model_config, vocab_size: int) -> dict:
  config = llama_hf.to_hf_config(ARCHITECTURE, 'deepseek_v3')(model_config, vocab_size)
  for key in ('mlp_bias', 'rope_theta'):
    del config[key]
  expert_dim = model_config.moe_mlp_dim or model_config.mlp_dim
  nope = config['head_dim']
  config.update(
      head_dim=model_config.mla_rope_dim, qk_nope_head_dim=nope,
      qk_rope_head_dim=model_config.mla_rope_dim, qk_head_dim=nope + model_config.mla_rope_dim,
      v_head_dim=model_config.mla_value_dim or nope, kv_lora_rank=model_config.mla_kv_rank,
      q_lora_rank=model_config.mla_q_rank or None,
      rope_interleave=bool(model_config.mla_rope_interleave), attention_bias=False,
      num_key_value_heads=model_config.num_heads, n_routed_experts=model_config.num_experts,
      num_experts_per_tok=model_config.experts_per_token, n_group=model_config.moe_groups,
      topk_group=model_config.moe_topk_groups,
      routed_scaling_factor=model_config.moe_routed_scale, moe_intermediate_size=expert_dim,
      n_shared_experts=model_config.moe_shared_expert // expert_dim, norm_topk_prob=True,
      first_k_dense_replace=model_config.moe_dense_layers, num_nextn_predict_layers=0)
  return config


def _unwritable(model) -> str:
  """What of `model` DeepseekV3ForCausalLM cannot write ('' if nothing)."""
  expert_dim = model.moe_mlp_dim or model.mlp_dim
  reasons = [
      (not model.get('mla_kv_rank', 0), 'model.mla_kv_rank=0 (DeepSeek-V3 attends through a '
       'latent)'),
      (model.moe_router != 'sigmoid_topk', f'model.moe_router={model.moe_router!r} (DeepSeek-V3 '
       'routes sigmoid_topk)'),
      (model.get('moe_balance', 'aux_loss') != 'aux_free', 'model.moe_balance=\'aux_loss\' '
       '(DeepSeek-V3 chooses with a router bias: aux_free)'),
      (model.moe_shared_expert % expert_dim, f'model.moe_shared_expert={model.moe_shared_expert} '
       f'(DeepSeek-V3 has whole shared experts of moe_mlp_dim={expert_dim})'),
      (model.qkv_bias or model.qk_norm, 'q/k/v biases or q/k norms (DeepSeek-V3 has neither)')]
  return next((why for refused, why in reasons if refused), '')


FORMATS = (HFFormat(ARCHITECTURE, 'llama', TENSORS, _deepseek_v3, _to_hf_config, moe=True,
                    latent=True, unwritable=_unwritable),)
