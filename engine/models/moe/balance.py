"""Auxiliary-loss-free expert balancing (DeepSeek-V3, model.moe_balance='aux_free').

Each MoE layer holds a per-expert bias that is added to the router's scores when the experts are
chosen, never when they are weighed (engine/models/moe/layer.py), so no gradient reaches it. After
every step the bias moves by the rate toward balance: up for an expert that received less than the
mean share of the step's token-assignments, down for one that received more, unchanged at the
mean. The load is the step's router statistic (moe.router_losses: the share of the whole batch's
assignments, averaged over micro-batches and pipeline stages as every statistic is), so the
update sees the global batch in every layout. The bias is a parameter like any other for
sharding and checkpoints; the optimizer's update of it is discarded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROUTER_BIAS = 'b_router_E'  # The bias' name among a MoE layer's parameters.


def updated_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
  """The bias after one step whose load [..., E] (each expert's share of its layer's
  assignments; the mean share is 1 / E) it chose with."""
  mean = 1.0 / load_E.shape[-1]
  return bias_E + rate * jnp.sign(mean - load_E).astype(bias_E.dtype)


class WholeBias:
  """How a step sees the router biases: whole, as in auto mode and the reference (manual mode
  sees this device's block of each: engine/parallel/manual.py)."""

  def block(self, whole: jax.Array, path, local: jax.Array) -> jax.Array:
    """`whole`, laid out like the whole bias at `path`, as this step holds that bias (`local`):
    [layers, E], or a circular pipeline's [repeats, layers / repeats, E]."""
    del path
    return whole.reshape(local.shape)

  def extremes(self, local: jax.Array, path) -> tuple[jax.Array, jax.Array]:
    """The least and the greatest value of the whole bias at `path`."""
    del path
    return local.min(), local.max()


def with_balanced_bias(params: dict, old_params: dict, load_LE: jax.Array, rate: float,
                       layout: WholeBias = WholeBias()) -> dict:
  """`params` (after the optimizer) with every router bias set to `updated_bias` of its value
  in `old_params`; `load_LE` [layers, E] is the step's load in the model's layer order."""
  def update(path, new, old):
    if not _is_bias(path):
      return new
    return updated_bias(old, layout.block(load_LE, path, old), rate)
  return jax.tree_util.tree_map_with_path(update, params, old_params)


def bias_metrics(params: dict, layout: WholeBias = WholeBias()) -> dict:
  """moe/bias_min, moe/bias_max: the router bias over every layer's experts ({} without one)."""
  extremes = [layout.extremes(bias, path)
              for path, bias in jax.tree_util.tree_leaves_with_path(params) if _is_bias(path)]
  if not extremes:
    return {}
  lows, highs = zip(*extremes)
  return {'moe/bias_min': jnp.min(jnp.stack(lows)), 'moe/bias_max': jnp.max(jnp.stack(highs))}


def _is_bias(path) -> bool:
  return getattr(path[-1], 'key', None) == ROUTER_BIAS
