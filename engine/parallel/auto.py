"""Auto mode: jax.jit with NamedShardings from the rules; XLA's SPMD partitioner inserts every
collective."""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.parallel.ops import AutoOps
from engine.parallel.steps import Steps
from engine.state import StateLayout, batch_sharding, clip_by_global_norm, next_token_loss


def build_steps(layout: StateLayout) -> Steps:
  ops = AutoOps(layout.mesh, layout.rules)
  state_shardings = layout.state_shardings()
  batch = batch_sharding(layout.mesh, layout.rules)
  replicated = NamedSharding(layout.mesh, P())

  def loss_fn(params, tokens_BL1):
    return next_token_loss(params, layout.graphdef, tokens_BL1, ops)

  def train_step(state, tokens_BL1):
    loss, grads = jax.value_and_grad(loss_fn)(state['params'], tokens_BL1)
    grad_norm = optax.tree.norm(grads)
    grads = clip_by_global_norm(grads, grad_norm, layout.max_grad_norm)
    updates, opt_state = layout.tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics = {'loss': loss, 'grad_norm': grad_norm}
    return {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state}, metrics

  return Steps(
      train=jax.jit(train_step, in_shardings=(state_shardings, batch),
                    out_shardings=(state_shardings, replicated), donate_argnums=0),
      eval=jax.jit(loss_fn, in_shardings=(state_shardings['params'], batch),
                   out_shardings=replicated))
