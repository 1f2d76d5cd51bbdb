"""A sparse (mixture-of-experts) SwiGLU feed-forward layer for the Llama-style block.

Each token's router logits pick `experts_per_token` (k) of `num_experts` (E) SwiGLU experts and
weigh their outputs (ROUTERS); an optional shared expert sees every token. Expert weights are
stacked along a leading `experts` logical axis, each expert's hidden dimension named `mlp` like
the dense MLP's (so tensor parallelism splits it the same way, with one `finish_contraction`).

Two dispatches (DISPATCHES), written in engine/models/moe/dispatch.py and run through
`ops.experts`, so that a layout splitting the experts over devices (the `expert` mesh axis) can
move the assignments to them and back:
  - dropless: the token-assignments sorted by expert and multiplied with grouped matmuls
    (`jax.lax.ragged_dot`), then unsorted. Nothing is dropped.
  - capacity: within each sequence, each expert takes at most
    C = ceil(length * k / E * capacity_factor) assignments, the first ones in (position,
    choice) order; later ones are dropped (they contribute zero; the residual carries the token).

With model.moe_balance='aux_free' a per-expert bias (engine/models/moe/balance.py) is added
to the scores that choose the experts, never to the weights.

The layer also returns its auxiliary loss: Switch's load-balancing loss E * sum_e f_e * P_e (f_e
the fraction of assignments routed to e, P_e the mean router probability of e) and the router
z-loss mean(logsumexp(logits)^2), each times its coefficient. Both are statistics of the whole
batch the layer sees (`ops.batch_mean` averages them over the devices that split it); so are
the router-health statistics it returns beside them for the metrics (load per expert, dropped
fraction), which carry no gradient.

Shape suffixes: B batch, L length, T tokens (B * L), D embed, E experts, K experts per token,
F expert hidden.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models import quantized_matmul
from engine.models.moe import balance as expert_balance
from engine.models.moe import config as moe_config
from engine.models.layers import dense, param
from engine.models.moe.dispatch import ExpertFFN, capacity
from engine.models.quantized_matmul import MatmulPrecision

# The choices of model.moe_router and model.moe_dispatch, declared with the keys.
ROUTERS, DISPATCHES, BALANCES = moe_config.ROUTERS, moe_config.DISPATCHES, moe_config.BALANCES


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  num_experts: int
  mlp_dim: int  # Each expert's hidden size.
  experts_per_token: int = 2
  router: str = 'softmax_topk'  # ROUTERS
  shared_expert_dim: int = 0  # 0: no shared expert.
  dispatch: str = 'dropless'  # DISPATCHES
  capacity_factor: float = 1.0
  aux_loss_coef: float = 0.0
  z_loss_coef: float = 0.0
  # sigmoid_topk: expert groups, how many of the best a token picks from, the weights' scale.
  groups: int = 1
  topk_groups: int = 1
  routed_scale: float = 1.0
  # aux_free: a per-expert bias on the scores that choose the experts (balance.py).
  balance: str = 'aux_loss'  # BALANCES
  bias_rate: float = 0.001
  # The shared expert's projections and a capacity dispatch's experts (the router and the
  # dropless dispatch's experts: the compute dtype).
  matmul: MatmulPrecision = quantized_matmul.DEFAULT


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """jax.lax.top_k over the last axis (largest first, the lower index on ties) as k argmaxes:
  XLA's SPMD partitioner gathers a top_k's whole input onto every device, but splits a
  reduction along the batch like any other."""
  values, indices = [], []
  for _ in range(k):
    index = jnp.argmax(x, axis=-1)
    values.append(jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0])
    indices.append(index)
    x = jnp.where(jax.nn.one_hot(index, x.shape[-1], dtype=bool), -jnp.inf, x)
  return jnp.stack(values, -1), jnp.stack(indices, -1)


def route(logits_TE: jax.Array, k: int, router: str, groups: int = 1, topk_groups: int = 1,
          routed_scale: float = 1.0, bias_E: jax.Array | None = None):
  """(weights [..., K], experts [..., K] int32, probabilities [..., E]) of float32 router logits
  [..., E]. sigmoid_topk's probabilities (for the balance loss) are its scores normalised.

  `bias_E` (aux_free balancing) is added to the scores the experts are chosen by (sigmoid_topk's
  scores, softmax_topk's probabilities, topk_softmax's logits), its groups' scores included;
  the weights are those of the unbiased scores, so no gradient reaches the bias."""
  chosen_by = lambda scores_TE: scores_TE if bias_E is None else scores_TE + bias_E
  if router == 'sigmoid_topk':
    scores_TE = jax.nn.sigmoid(logits_TE)
    _, experts_TK = top_k(_in_best_groups(chosen_by(scores_TE), groups, topk_groups), k)
    top_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    weights_TK = top_TK / top_TK.sum(-1, keepdims=True) * routed_scale
    return (weights_TK, experts_TK.astype(jnp.int32),
            scores_TE / scores_TE.sum(-1, keepdims=True))
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  scores_TE = probs_TE if router == 'softmax_topk' else logits_TE
  if bias_E is None:  # The values top_k found: gathering them again from the scores holds
    top_TK, experts_TK = top_k(scores_TE, k)  # another [T, E] in the backward pass.
  else:
    _, experts_TK = top_k(chosen_by(scores_TE), k)
    top_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
  if router == 'softmax_topk':
    weights_TK = top_TK / top_TK.sum(-1, keepdims=True)
  else:
    weights_TK = jax.nn.softmax(top_TK, axis=-1)
  return weights_TK, experts_TK.astype(jnp.int32), probs_TE


def _in_best_groups(scores_TE: jax.Array, groups: int, best: int) -> jax.Array:
  """The scores of the experts in each token's `best` groups, -inf elsewhere: a group scores the
  sum of its two best experts' scores (DeepSeek-V3's group-limited routing)."""
  if groups == 1:
    return scores_TE
  *lead, E = scores_TE.shape
  grouped = scores_TE.reshape(*lead, groups, E // groups)
  group_scores = top_k(grouped, min(2, E // groups))[0].sum(-1)  # [..., groups]
  _, chosen = top_k(group_scores, best)
  keep = jax.nn.one_hot(chosen, groups, dtype=bool).any(-2)  # [..., groups]
  return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(scores_TE.shape)


def router_losses(logits_TE, probs_TE, experts_TK, ops):
  """(Switch load-balancing loss, router z-loss, load [E]), unweighted, over the whole batch:
  the balance loss multiplies two batch means, so each is averaged over the devices
  (`ops.batch_mean`) before the product, not the product after it. load [E]: the fraction of
  the assignments routed to each expert (sums to 1)."""
  E = logits_TE.shape[-1]
  assigned_E = jax.nn.one_hot(experts_TK, E, dtype=jnp.float32).sum((0, 1))
  fraction_E = ops.batch_mean(assigned_E / experts_TK.size)
  balance = E * jnp.sum(fraction_E * ops.batch_mean(probs_TE.mean(0)))
  z = ops.batch_mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1))))
  return balance, z, fraction_E


class MoeMlp(nnx.Module):
  """Router, E stacked SwiGLU experts and an optional shared SwiGLU expert."""

  def __init__(self, embed_dim: int, cfg: MoeConfig, init_std: float, rngs: nnx.Rngs):
    D, E, F, S = embed_dim, cfg.num_experts, cfg.mlp_dim, cfg.shared_expert_dim
    self.cfg = cfg
    # The router's expert dimension is unnamed: every device scores every expert, even where the
    # experts themselves are split over the `expert` mesh axis.
    self.w_router_DE = param(rngs, (D, E), ('embed', None), init_std)
    if cfg.balance == 'aux_free':  # Moved by the train step, not the optimizer (no gradient).
      setattr(self, expert_balance.ROUTER_BIAS, param(rngs, (E,), (None,), 0))
    self.w_gate_EDF = param(rngs, (E, D, F), ('experts', 'embed', 'mlp'), init_std)
    self.w_up_EDF = param(rngs, (E, D, F), ('experts', 'embed', 'mlp'), init_std)
    self.w_down_EFD = param(rngs, (E, F, D), ('experts', 'mlp', 'embed'), init_std)
    if S:
      self.w_shared_gate_DS = param(rngs, (D, S), ('embed', 'mlp'), init_std)
      self.w_shared_up_DS = param(rngs, (D, S), ('embed', 'mlp'), init_std)
      self.w_shared_down_SD = param(rngs, (S, D), ('mlp', 'embed'), init_std)

  def __call__(self, x_BLD: jax.Array, ops):
    """(y [B, L, D], auxiliary loss scalar, router statistics {'balance', 'z' (unweighted
    losses), 'dropped' (the fraction of assignments dropped), 'load' [E] (the fraction routed
    to each expert)}, each over the whole batch)."""
    cfg = self.cfg
    B, L, D = x_BLD.shape
    # The router reads x before column_parallel_input: its input gradient is whole already.
    logits_BLE = ops.constrain(dense(x_BLD, self.w_router_DE[...],
                                     preferred_element_type=jnp.float32).astype(jnp.float32),
                               ('batch', 'length', None))
    bias_E = None
    if cfg.balance == 'aux_free':
      bias_E = jax.lax.stop_gradient(
          getattr(self, expert_balance.ROUTER_BIAS)[...].astype(jnp.float32))
    weights_BLK, experts_BLK, probs_BLE = route(logits_BLE, cfg.experts_per_token, cfg.router,
                                                cfg.groups, cfg.topk_groups, cfg.routed_scale,
                                                bias_E)
    logits_TE, probs_TE = logits_BLE.reshape(B * L, -1), probs_BLE.reshape(B * L, -1)
    weights_TK, experts_TK = weights_BLK.reshape(B * L, -1), experts_BLK.reshape(B * L, -1)
    x_BLD = ops.column_parallel_input(x_BLD, 'mlp')
    ffn = ExpertFFN(self.w_gate_EDF[...], self.w_up_EDF[...], self.w_down_EFD[...],
                    lambda y: ops.finish_contraction(y, 'mlp'),
                    cfg.matmul if cfg.dispatch == 'capacity' else quantized_matmul.DEFAULT,
                    ops.ragged_dot)
    slots = (None if cfg.dispatch == 'dropless' else
             capacity(L, cfg.experts_per_token, cfg.num_experts, cfg.capacity_factor))
    y_BLKD, dropped = ops.experts(x_BLD, experts_BLK, ffn, cfg.num_experts, slots)
    y_TKD = y_BLKD.reshape(B * L, -1, D)
    x_TD = x_BLD.reshape(B * L, D)
    y_TD = jnp.einsum('tkd,tk->td', y_TKD, weights_TK.astype(y_TKD.dtype))
    if cfg.shared_expert_dim:
      shared = functools.partial(dense, precision=cfg.matmul)
      h_TS = jax.nn.silu(shared(x_TD, self.w_shared_gate_DS[...])) * shared(
          x_TD, self.w_shared_up_DS[...])
      y_TD = y_TD + ops.finish_contraction(shared(h_TS, self.w_shared_down_SD[...]), 'mlp')
    balance, z, load_E = router_losses(logits_TE, probs_TE, experts_TK, ops)
    aux = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
    if cfg.dispatch != 'dropless':  # Dropless drops nothing: no collective for its zero.
      dropped = ops.batch_mean(dropped)
    # The statistics are for the metrics only: no gradient flows through them.
    stats = jax.lax.stop_gradient({'balance': balance, 'z': z, 'load': load_E,
                                   'dropped': dropped})
    return y_TD.reshape(B, L, D), aux, stats
