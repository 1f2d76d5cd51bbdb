"""A sparse (mixture-of-experts) SwiGLU feed-forward layer for the Llama-style block.

Each token's router logits pick `experts_per_token` (k) of `num_experts` (E) SwiGLU experts and
weigh their outputs (ROUTERS); an optional shared expert sees every token. Expert weights are
stacked along a leading `experts` logical axis, each expert's hidden dimension named `mlp` like
the dense MLP's (so tensor parallelism splits it the same way, with one `finish_contraction`).

Two dispatches (DISPATCHES), both over the layer's whole [batch * length] token set:
  - dropless: the T * k token-assignments sorted by expert and multiplied with grouped matmuls
    (`jax.lax.ragged_dot`), then unsorted. Nothing is dropped.
  - capacity: each expert takes at most C = ceil(T * k / E * capacity_factor) assignments, the
    first ones in (token, choice) order; later ones are dropped (they contribute zero).

The layer also returns its auxiliary loss: Switch's load-balancing loss E * sum_e f_e * P_e (f_e
the fraction of assignments routed to e, P_e the mean router probability of e) and the router
z-loss mean(logsumexp(logits)^2), each times its coefficient. Both are statistics of the whole
token set the layer sees.

Shape suffixes: T tokens (batch * length), D embed, E experts, K experts per token, F expert
hidden, A assignments (T * K), C capacity slots per expert.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.layers import dense, param

# softmax_topk: softmax over all experts, keep the top k, renormalise them (Mixtral, Qwen-MoE
# with norm_topk_prob). topk_softmax: the top k logits, softmax over those k.
ROUTERS = ('softmax_topk', 'topk_softmax')
DISPATCHES = ('dropless', 'capacity')


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


def route(logits_TE: jax.Array, k: int, router: str):
  """(weights [T, K], experts [T, K] int32, probabilities [T, E]) of float32 router logits."""
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  if router == 'softmax_topk':
    top_TK, experts_TK = jax.lax.top_k(probs_TE, k)
    weights_TK = top_TK / top_TK.sum(-1, keepdims=True)
  else:
    top_TK, experts_TK = jax.lax.top_k(logits_TE, k)
    weights_TK = jax.nn.softmax(top_TK, axis=-1)
  return weights_TK, experts_TK.astype(jnp.int32), probs_TE


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


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
  """Slots per expert of the capacity dispatch."""
  return max(1, math.ceil(tokens * k / experts * factor))


def capacity_slots(experts_TK: jax.Array, num_experts: int, slots: int):
  """(slot [A] in [0, E * C), or E * C for a dropped assignment; kept [A] bool). Assignment
  a = t * K + i takes the next free slot of its expert, in that order."""
  experts_A = experts_TK.reshape(-1)
  onehot_AE = jax.nn.one_hot(experts_A, num_experts, dtype=jnp.int32)
  position_A = jnp.take_along_axis(jnp.cumsum(onehot_AE, axis=0) - 1, experts_A[:, None],
                                   axis=1)[:, 0]
  kept_A = position_A < slots
  return jnp.where(kept_A, experts_A * slots + position_A, num_experts * slots), kept_A


class MoeMlp(nnx.Module):
  """Router, E stacked SwiGLU experts and an optional shared SwiGLU expert."""

  def __init__(self, embed_dim: int, cfg: MoeConfig, init_std: float, rngs: nnx.Rngs):
    D, E, F, S = embed_dim, cfg.num_experts, cfg.mlp_dim, cfg.shared_expert_dim
    self.cfg = cfg
    # The router's expert dimension is unnamed: every device scores every expert, even where the
    # experts themselves are split over the `expert` mesh axis.
    self.w_router_DE = param(rngs, (D, E), ('embed', None), init_std)
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
    logits_TE = dense(x_BLD.reshape(B * L, D), self.w_router_DE[...],
                      preferred_element_type=jnp.float32).astype(jnp.float32)
    weights_TK, experts_TK, probs_TE = route(logits_TE, cfg.experts_per_token, cfg.router)
    x_TD = ops.column_parallel_input(x_BLD, 'mlp').reshape(B * L, D)
    if cfg.dispatch == 'dropless':
      y_TKD, dropped = self.dropless(x_TD, experts_TK, ops), jnp.zeros((), jnp.float32)
    else:
      y_TKD, dropped = self.with_capacity(x_TD, experts_TK, ops)
    y_TD = jnp.einsum('tkd,tk->td', y_TKD, weights_TK.astype(y_TKD.dtype))
    if cfg.shared_expert_dim:
      h_TS = jax.nn.silu(dense(x_TD, self.w_shared_gate_DS[...])) * dense(
          x_TD, self.w_shared_up_DS[...])
      y_TD = y_TD + ops.finish_contraction(dense(h_TS, self.w_shared_down_SD[...]), 'mlp')
    balance, z, load_E = router_losses(logits_TE, probs_TE, experts_TK, ops)
    aux = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
    if cfg.dispatch != 'dropless':  # Dropless drops nothing: no collective for its zero.
      dropped = ops.batch_mean(dropped)
    # The statistics are for the metrics only: no gradient flows through them.
    stats = jax.lax.stop_gradient({'balance': balance, 'z': z, 'load': load_E,
                                   'dropped': dropped})
    return y_TD.reshape(B, L, D), aux, stats

  def dropless(self, x_TD, experts_TK, ops):
    """[T, K, D]: every assignment's expert output, by grouped matmuls over sorted rows."""
    T, K = experts_TK.shape
    experts_A = experts_TK.reshape(-1)
    order_A = jnp.argsort(experts_A, stable=True)  # Assignments grouped by expert.
    group_sizes_E = jnp.bincount(experts_A, length=self.cfg.num_experts).astype(jnp.int32)
    x_AD = x_TD[order_A // K]
    gate_AF = jax.lax.ragged_dot(x_AD, self.w_gate_EDF[...], group_sizes_E)
    up_AF = jax.lax.ragged_dot(x_AD, self.w_up_EDF[...], group_sizes_E)
    y_AD = jax.lax.ragged_dot(jax.nn.silu(gate_AF) * up_AF, self.w_down_EFD[...], group_sizes_E)
    y_AD = ops.finish_contraction(y_AD, 'mlp')
    return y_AD[jnp.argsort(order_A)].reshape(T, K, -1)  # Back to (token, choice) order.

  def with_capacity(self, x_TD, experts_TK, ops):
    """([T, K, D] expert outputs, zero where dropped; the fraction of assignments dropped)."""
    T, K = experts_TK.shape
    E, D = self.cfg.num_experts, x_TD.shape[-1]
    C = capacity(T, K, E, self.cfg.capacity_factor)
    slot_A, kept_A = capacity_slots(experts_TK, E, C)
    token_A = jnp.arange(T * K) // K
    x_ECD = jnp.zeros((E * C, D), x_TD.dtype).at[slot_A].set(
        x_TD[token_A], mode='drop').reshape(E, C, D)
    gate_ECF = jnp.einsum('ecd,edf->ecf', x_ECD, self.w_gate_EDF[...])
    up_ECF = jnp.einsum('ecd,edf->ecf', x_ECD, self.w_up_EDF[...])
    y_ECD = jnp.einsum('ecf,efd->ecd', jax.nn.silu(gate_ECF) * up_ECF, self.w_down_EFD[...])
    y_ECD = ops.finish_contraction(y_ECD, 'mlp')
    y_AD = jnp.take(y_ECD.reshape(E * C, D), slot_A, axis=0, mode='fill', fill_value=0)
    dropped = 1.0 - kept_A.astype(jnp.float32).mean()
    return y_AD.reshape(T, K, D), dropped
