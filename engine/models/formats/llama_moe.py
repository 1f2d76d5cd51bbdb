"""The Llama family's mixture-of-experts Hugging Face checkpoints: Mixtral (`MixtralForCausalLM`)
and Qwen3-MoE (`Qwen3MoeForCausalLM`), computed by the engine's Llama with model.num_experts > 0
(engine/models/moe/layer.py). Attention, norms and embeddings are llama.py's; the MLP's tensors
are, per layer i and expert e:

  Mixtral   model.layers.{i}.block_sparse_moe.gate.weight           [E, D]  blocks/moe/w_router_DE
            model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight [F, D]  blocks/moe/w_gate_EDF
            model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight [F, D]  blocks/moe/w_up_EDF
            model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight [D, F]  blocks/moe/w_down_EFD
  Qwen3-MoE model.layers.{i}.mlp.gate.weight and mlp.experts.{e}.{gate,up,down}_proj.weight

(engine: router [L, D, E], experts [L, E, D, F] / [L, E, F, D]). transformers 5 fuses the
experts in memory (gate_up_proj [E, 2F, D]) but its save_pretrained writes these per-expert
names, and its from_pretrained reads them. Both route softmax over every expert, top k,
renormalised (the engine's softmax_topk); Hugging Face's MoE inference drops nothing, so an
imported model uses moe_dispatch=dropless. Refused: Qwen3-MoE's norm_topk_prob=false (weights
not renormalised), dense layers among the sparse ones (decoder_sparse_step, mlp_only_layers: the
engine's stacked layers are alike), Mixtral's router_jitter_noise. router_aux_loss_coef is a
training setting, not read (model.moe_aux_loss_coef is the engine's, summed over layers).
"""

from __future__ import annotations

from engine.models.formats import llama as llama_hf
from engine.models.formats.interface import HFFormat, HFTensor, UnsupportedCheckpoint

_LAYER = 'model.layers.{i}.'
_DENSE_MLP = ('blocks/w_gate_DF', 'blocks/w_up_DF', 'blocks/w_down_FD')
_ATTENTION = tuple(t for t in llama_hf.TENSORS if t.path not in _DENSE_MLP)


def _moe_tensors(block: str, gate: str, up: str, down: str) -> tuple[HFTensor, ...]:
  experts = _LAYER + block + '.experts.{e}.'
  return _ATTENTION + (
      HFTensor('blocks/moe/w_router_DE', _LAYER + block + '.gate.weight', 'linear'),
      HFTensor('blocks/moe/w_gate_EDF', experts + gate + '.weight', 'linear'),
      HFTensor('blocks/moe/w_up_EDF', experts + up + '.weight', 'linear'),
      HFTensor('blocks/moe/w_down_EFD', experts + down + '.weight', 'linear'))


MIXTRAL_TENSORS = _moe_tensors('block_sparse_moe', 'w1', 'w3', 'w2')
QWEN3_MOE_TENSORS = _moe_tensors('mlp', 'gate_proj', 'up_proj', 'down_proj')


def _num_experts(hf: dict) -> int:
  """transformers 5 writes num_local_experts for both; older Qwen3-MoE files num_experts."""
  return int(hf['num_local_experts'] if 'num_local_experts' in hf else hf['num_experts'])


def _moe(hf: dict, expert_dim: int) -> dict:
  return {'num_experts': _num_experts(hf), 'experts_per_token': int(hf['num_experts_per_tok']),
          'moe_router': 'softmax_topk', 'moe_mlp_dim': int(expert_dim), 'moe_shared_expert': 0,
          'moe_dispatch': 'dropless'}


def _mixtral(hf: dict, where: str) -> dict:
  jitter = float(hf.get('router_jitter_noise') or 0.0)
  if jitter:
    raise UnsupportedCheckpoint(
        f'{where}: router_jitter_noise={jitter:g} is not supported (Mixtral multiplies the '
        'router\'s input by random noise while training; the engine does not); set it to 0.0 in '
        'config.json to fine-tune without it.')
  llama_hf.no_attention_bias(hf, where)
  return {**llama_hf.common(hf, where, 'MixtralForCausalLM'), **_moe(hf, hf['intermediate_size'])}


def _qwen3_moe(hf: dict, where: str) -> dict:
  if not hf.get('norm_topk_prob', False):
    raise UnsupportedCheckpoint(
        f'{where}: norm_topk_prob={hf.get("norm_topk_prob", False)} is not supported (the top-k '
        'router weights used as they are); the engine\'s router renormalises them to sum to 1 '
        '(model.moe_router=softmax_topk): load a checkpoint with norm_topk_prob=true.')
  step, dense = hf.get('decoder_sparse_step', 1), hf.get('mlp_only_layers') or []
  if step != 1 or dense or _num_experts(hf) < 1:
    raise UnsupportedCheckpoint(
        f'{where}: decoder_sparse_step={step}, mlp_only_layers={list(dense)}, num_experts='
        f'{_num_experts(hf)} make some layers dense; the engine stacks alike layers, every one '
        'a mixture of experts: load a checkpoint with decoder_sparse_step=1, mlp_only_layers=[].')
  llama_hf.no_attention_bias(hf, where)
  return {**llama_hf.common(hf, where, 'Qwen3MoeForCausalLM'), 'qk_norm': True,
          **_moe(hf, hf['moe_intermediate_size'])}


def _to_hf_config(architecture: str, model_type: str):
  dense = llama_hf.to_hf_config(architecture, model_type)

  def to_hf_config(model_config, vocab_size: int) -> dict:
    config = dense(model_config, vocab_size)
    del config['mlp_bias']  # Neither architecture has the key.
    expert_dim = model_config.moe_mlp_dim or model_config.mlp_dim
    config['num_experts_per_tok'] = model_config.experts_per_token
    if architecture == 'MixtralForCausalLM':
      config.update(num_local_experts=model_config.num_experts, intermediate_size=expert_dim,
                    router_jitter_noise=0.0, sliding_window=model_config.sliding_window or None)
    else:  # Qwen3-MoE: `num_experts` is what transformers 4 reads too (5 maps it).
      config.update(num_experts=model_config.num_experts, moe_intermediate_size=expert_dim,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return config
  return to_hf_config


def _unwritable(architecture: str, qk_norm: bool):
  def why(model) -> str:
    """What of the model `architecture` cannot write ('' if nothing)."""
    if latent := llama_hf.no_latent_attention(architecture)(model):
      return latent
    if model.moe_router != 'softmax_topk':
      return (f'model.moe_router={model.moe_router!r} ({architecture} routes softmax_topk: a '
              'softmax over every expert, the top k renormalised)')
    if model.get('moe_balance', 'aux_loss') == 'aux_free':
      return (f"model.moe_balance='aux_free' ({architecture} has no router bias to choose the "
              'experts with)')
    if model.moe_shared_expert:
      return (f'model.moe_shared_expert={model.moe_shared_expert} ({architecture} has no shared '
              'expert)')
    if model.qkv_bias:
      return f'model.qkv_bias=True ({architecture} has no q/k/v biases)'
    if bool(model.qk_norm) != qk_norm:
      return (f'model.qk_norm={bool(model.qk_norm)} ({architecture} '
              f'{"normalises" if qk_norm else "does not normalise"} each query and key head)')
    return ''
  return why


FORMATS = (
    HFFormat('MixtralForCausalLM', 'llama', MIXTRAL_TENSORS, _mixtral,
             _to_hf_config('MixtralForCausalLM', 'mixtral'), moe=True,
             unwritable=_unwritable('MixtralForCausalLM', False)),
    HFFormat('Qwen3MoeForCausalLM', 'llama', QWEN3_MOE_TENSORS, _qwen3_moe,
             _to_hf_config('Qwen3MoeForCausalLM', 'qwen3_moe'), moe=True,
             unwritable=_unwritable('Qwen3MoeForCausalLM', True)),
)
