"""Expert parallelism in manual mode: a mixture of experts' dispatch with the experts split over
the `expert` mesh axis, its token exchange written as `jax.lax.all_to_all` inside shard_map.

Each device routes its own tokens (the expert axis also splits the batch), sends every
assignment to the device holding its expert, runs its own experts on what arrives, and sends
the results back to where the tokens live; the layer then weighs and sums them as on one device.

- capacity: the [E, B, C, D] slot buffer of engine/models/moe_dispatch.py is already laid out by
  expert: one all_to_all gives each device its E / n experts' slots from all n devices' sequences,
  one more returns the outputs. Drops are decided per sequence, so they match one device's.
- dropless: the assignments sorted by expert are packed into n fixed-size blocks, block j for
  device j (all_to_all needs equal blocks: T * min(K, E / n) rows each, the most one device's
  tokens can send one device), with each row's local expert id beside it; the receiver sorts
  the rows by expert, runs its grouped matmuls, and the reverse trip retraces the same slots.
  The padding rows are zeros and stay zero. `ragged_all_to_all` would send only the rows in use,
  but XLA:CPU cannot run it; the padded exchange is exact everywhere.

The transpose of an all_to_all is the reverse all_to_all, so an expert's weight gradient sums
the contributions of every device's tokens on the device that holds it; the gradient average
(engine/parallel/manual_ops.py, batch_reduction) divides by the expert axis' size instead of
averaging over it, as FSDP divides after its reduce-scatter.

Shape suffixes: T tokens here, K choices, A assignments (T * K), n expert-axis size, E experts,
E_here = E / n, R rows per block, D embed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models import moe_dispatch


def capacity_exchange(axis: str):
  """The `exchange` of moe_dispatch.with_capacity: the slot buffer to the experts and back."""

  def exchange(x_EBCD, through_experts):
    x_here = jax.lax.all_to_all(x_EBCD, axis, split_axis=0, concat_axis=1, tiled=True)
    y_here = through_experts(x_here)  # [E_here, n * B, C, D], sources in device order.
    return jax.lax.all_to_all(y_here, axis, split_axis=1, concat_axis=0, tiled=True)

  return exchange


def dropless(x_TD: jax.Array, experts_TK: jax.Array, ffn: moe_dispatch.ExpertFFN,
             num_experts: int, axis: str, n: int) -> jax.Array:
  """[T, K, D]: every assignment's expert output, computed on the device holding the expert."""
  T, K = experts_TK.shape
  E_here = num_experts // n
  R = T * min(K, E_here)
  experts_A = experts_TK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)
  expert_A = experts_A[order_A]
  device_A = expert_A // E_here
  sent_n = jnp.bincount(device_A, length=n)
  # Sorted by expert, hence by device: row a is row (a - first row for its device) of its block.
  row_A = device_A * R + jnp.arange(T * K) - (jnp.cumsum(sent_n) - sent_n)[device_A]
  send_xD = jnp.zeros((n * R, x_TD.shape[1]), x_TD.dtype).at[row_A].set(x_TD[order_A // K])
  send_expert = jnp.full((n * R,), E_here, jnp.int32).at[row_A].set(expert_A % E_here)
  swap = lambda v: jax.lax.all_to_all(v.reshape(n, R, *v.shape[1:]), axis, 0, 0, tiled=True)
  got_xD, got_expert = swap(send_xD).reshape(n * R, -1), swap(send_expert).reshape(n * R)
  # Here: rows from every device, each tagged with one of this device's experts (E_here: none).
  by_expert = jnp.argsort(got_expert, stable=True)
  sizes = jnp.bincount(got_expert, length=E_here + 1)[:E_here].astype(jnp.int32)
  y_here = ffn.grouped(got_xD[by_expert], sizes)
  y_here = jnp.where((got_expert[by_expert] < E_here)[:, None], y_here, 0)
  back_xD = swap(y_here[jnp.argsort(by_expert)]).reshape(n * R, -1)
  return back_xD[row_A][jnp.argsort(order_A)].reshape(T, K, -1)
