"""The mixture-of-experts keys (model.num_experts and model.moe_*; engine/models/moe/layer.py) and
their checks: the Llama family's, declared apart from the layer so that engine.config reads them
without JAX."""

from __future__ import annotations

import math

from engine.models.config_keys import ConfigKey, ModelConfigError

# softmax_topk: softmax over all experts, keep the top k, renormalise them (Mixtral, Qwen-MoE
# with norm_topk_prob). topk_softmax: the top k logits, softmax over those k. sigmoid_topk:
# DeepSeek-V3's sigmoid scores, the top k within the moe_topk_groups best of moe_groups expert
# groups, renormalised and scaled by moe_routed_scale.
ROUTERS = ('softmax_topk', 'topk_softmax', 'sigmoid_topk')
DISPATCHES = ('dropless', 'capacity')
# aux_loss: Switch's load-balancing loss (moe_aux_loss_coef) alone. aux_free: DeepSeek-V3's
# auxiliary-loss-free balancing besides it: a per-expert bias added to the router's scores for
# choosing the experts only, moved by moe_bias_rate after each step toward balance.
BALANCES = ('aux_loss', 'aux_free')

CONFIG_KEYS = (
    ConfigKey('num_experts', 0, "Llama: a mixture of experts in place of each block's MLP "
              '(engine/models/moe/layer.py): this many SwiGLU experts; 0: the dense MLP.',
              exclusive=True),
    ConfigKey('experts_per_token', 2, 'Llama MoE: experts each token is routed to (top-k).'),
    ConfigKey('moe_router', 'softmax_topk', 'Llama MoE: softmax_topk (softmax over all experts, '
              'the top k renormalised: Mixtral, Qwen-MoE) | topk_softmax (the top k logits, '
              'softmax over those k) | sigmoid_topk (DeepSeek-V3: sigmoid scores, the top k of '
              'the best moe_topk_groups groups, renormalised, times moe_routed_scale).'),
    ConfigKey('moe_groups', 1, 'Llama MoE, sigmoid_topk: the experts in this many equal groups, '
              "each scored by its two best experts' scores (DeepSeek-V3's n_group)."),
    ConfigKey('moe_topk_groups', 1, 'Llama MoE, sigmoid_topk: a token picks its experts from '
              "this many best groups (DeepSeek-V3's topk_group)."),
    ConfigKey('moe_routed_scale', 1.0, "Llama MoE, sigmoid_topk: the routed experts' weights "
              "are multiplied by this (DeepSeek-V3's routed_scaling_factor)."),
    ConfigKey('moe_dense_layers', 0, 'Llama MoE: the first this many layers keep the dense '
              "MLP (mlp_dim), the others are mixtures of experts (DeepSeek-V3's "
              'first_k_dense_replace). They run one by one before the stacked layers: under '
              'pipeline stages, on every stage with the embedding.'),
    ConfigKey('moe_mlp_dim', 0, "Llama MoE: each expert's hidden size; 0: mlp_dim."),
    ConfigKey('moe_shared_expert', 0, 'Llama MoE: hidden size of a shared SwiGLU expert every '
              'token also goes through; 0: none.'),
    ConfigKey('moe_dispatch', 'dropless', 'Llama MoE: dropless (grouped matmuls over tokens '
              'sorted by expert) | capacity (each expert takes at most moe_capacity_factor * '
              'length * k / experts assignments of each sequence; later ones are dropped).'),
    ConfigKey('moe_capacity_factor', 1.25, 'Llama MoE, capacity dispatch: see moe_dispatch.'),
    ConfigKey('moe_aux_loss_coef', 0.01, "Llama MoE: weight of Switch's load-balancing loss "
              '(experts * sum_e f_e * P_e), per layer.'),
    ConfigKey('moe_balance', 'aux_loss', "Llama MoE: aux_loss (Switch's loss, "
              'moe_aux_loss_coef) | aux_free (DeepSeek-V3: also a per-expert router bias that '
              'only chooses the experts, never weighs them, moved after every step by '
              'moe_bias_rate toward the mean load: up for an underloaded expert, down for an '
              'overloaded one; set moe_aux_loss_coef=0 for the bias alone).'),
    ConfigKey('moe_bias_rate', 0.001, "Llama MoE, aux_free: each step's change of the router "
              "bias (DeepSeek-V3's gamma)."),
    ConfigKey('moe_z_loss_coef', 0.0, 'Llama MoE: weight of the router z-loss, '
              'mean(logsumexp(router logits)^2), per layer.'),
)


def stacked_layers(model) -> int:
  """The layers of the model's stack (pipeline stages split these): all but the dense layers
  that come first in a mixture of experts."""
  return model.num_layers - (model.get('moe_dense_layers', 0) if model.get('num_experts', 0)
                             else 0)


def stacked_layers_text(model) -> str:
  """The stacked layers as the config sets them, for an error line."""
  dense = model.num_layers - stacked_layers(model)
  if not dense:
    return f'model.num_layers={model.num_layers}'
  return (f'model.num_layers={model.num_layers} less model.moe_dense_layers={dense} '
          f'({model.num_layers - dense} in the stack)')


def check(model, mesh: dict[str, int]) -> None:
  """The MoE keys' values and the expert axis' split of them (a dense model: num_experts=0)."""
  if model.num_experts < 0:
    raise ModelConfigError(f'model.num_experts={model.num_experts} must be >= 0; give 0 for the '
                           'dense MLP, or the number of experts.')
  dense = model.get('moe_dense_layers', 0)
  if not model.num_experts:
    if dense:
      raise ModelConfigError(f'model.moe_dense_layers={dense} needs a mixture of experts after '
                             'the dense layers; set model.num_experts, or moe_dense_layers=0.')
    return
  if not 0 <= dense < model.num_layers:
    raise ModelConfigError(
        f'model.moe_dense_layers={dense} must lie in [0, model.num_layers={model.num_layers}); '
        'leave at least one mixture-of-experts layer.')
  if not 1 <= model.experts_per_token <= model.num_experts:
    raise ModelConfigError(
        f'model.experts_per_token={model.experts_per_token} must lie in [1, model.num_experts='
        f'{model.num_experts}]; route each token to at least one and at most every expert.')
  if model.num_experts % mesh['expert']:
    raise ModelConfigError(
        f"model.num_experts={model.num_experts} does not split over mesh.expert={mesh['expert']} "
        'devices; make mesh.expert a divisor of it (each device holds num_experts / expert '
        'experts).')
  for key, choices in (('moe_router', ROUTERS), ('moe_dispatch', DISPATCHES),
                       ('moe_balance', BALANCES)):
    if model[key] not in choices:
      raise ModelConfigError(f'model.{key}={model[key]!r} is unknown; choose one of {choices}.')
  _check_groups(model)
  factor = model.moe_capacity_factor
  if not (math.isfinite(factor) and factor > 0):
    raise ModelConfigError(f'model.moe_capacity_factor={factor} must be a positive number; each '
                           'expert takes ceil(length * k / experts * factor) assignments of each '
                           'sequence (e.g. 1.25).')
  rate = model.moe_bias_rate
  if model.moe_balance == 'aux_free' and not (math.isfinite(rate) and rate > 0):
    raise ModelConfigError(f'model.moe_bias_rate={rate} must be a positive number under '
                           "moe_balance='aux_free' (DeepSeek-V3: 0.001).")
  for key in ('moe_mlp_dim', 'moe_shared_expert', 'moe_aux_loss_coef', 'moe_z_loss_coef'):
    if not (math.isfinite(model[key]) and model[key] >= 0):
      raise ModelConfigError(f'model.{key}={model[key]} must be a number >= 0; give 0 or more.')


def _check_groups(model) -> None:
  """sigmoid_topk's expert groups: equal, enough for k experts; other routers use none."""
  groups, best = model.moe_groups, model.moe_topk_groups
  if model.moe_router != 'sigmoid_topk':
    if (groups, best, model.moe_routed_scale) != (1, 1, 1.0):
      raise ModelConfigError(
          f'model.moe_groups, moe_topk_groups and moe_routed_scale are sigmoid_topk\'s; '
          f'model.moe_router={model.moe_router!r} would ignore them: set '
          "--config.model.moe_router=sigmoid_topk, or leave them at 1, 1 and 1.0.")
    return
  if groups < 1 or model.num_experts % groups:
    raise ModelConfigError(f'model.moe_groups={groups} must divide model.num_experts='
                           f'{model.num_experts} into equal groups.')
  per_group = model.num_experts // groups
  if not 1 <= best <= groups or best * per_group < model.experts_per_token:
    raise ModelConfigError(
        f'model.moe_topk_groups={best} must lie in [1, model.moe_groups={groups}] and its groups '
        f'hold at least model.experts_per_token={model.experts_per_token} experts ({per_group} '
        'per group).')
  if not (math.isfinite(model.moe_routed_scale) and model.moe_routed_scale > 0):
    raise ModelConfigError(f'model.moe_routed_scale={model.moe_routed_scale} must be a positive '
                           'number (DeepSeek-V3: 2.5).')
