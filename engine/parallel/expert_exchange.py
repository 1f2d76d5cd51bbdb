"""Expert parallelism in manual mode: a mixture of experts' dispatch with the experts split over
the `expert` mesh axis, its token exchange written as `jax.lax.all_to_all` inside shard_map.

Each device routes its own tokens (the expert axis also splits the batch), sends every
assignment to the device holding its expert, runs its own experts on what arrives, and sends
the results back to where the tokens live; the layer then weighs and sums them as on one device.

- capacity: the [E, B, C, D] slot buffer of engine/models/moe/dispatch.py is already laid out by
  expert: one all_to_all gives each device its E / n experts' slots from all n devices' sequences,
  one more returns the outputs. Drops are decided per sequence, so they match one device's.
- dropless: the assignments sorted by expert are packed into n fixed-size blocks, block j for
  device j (T * min(K, E / n) rows each, the most one device's tokens can send one device); the
  receiver sorts the rows by expert, runs its grouped matmuls (the unused rows in no group), and
  the reverse trip retraces the same slots. On TPU and GPU the blocks travel by
  `jax.lax.ragged_all_to_all`, which sends only each block's rows in use into the same slots of
  the receiver's buffer, after an all_to_all of the counts per (device, expert), from which the
  receiver knows each row's expert. XLA:CPU cannot run it, so there the whole blocks travel by
  all_to_all, the unused rows as zeros, each row's local expert id in a block of its own. Both
  leave the receiver the same rows and experts (`exchange_kind` names the one a layout uses).

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

from engine.models.moe import dispatch as moe_dispatch
from engine.models.moe import tiled_ragged_dot


def capacity_exchange(axis: str):
  """The `exchange` of moe_dispatch.with_capacity: the slot buffer to the experts and back."""

  def exchange(x_EBCD, through_experts):
    x_here = jax.lax.all_to_all(x_EBCD, axis, split_axis=0, concat_axis=1, tiled=True)
    y_here = through_experts(x_here)  # [E_here, n * B, C, D], sources in device order.
    return jax.lax.all_to_all(y_here, axis, split_axis=1, concat_axis=0, tiled=True)

  return exchange


RAGGED, PADDED = 'ragged_all_to_all', 'all_to_all'


def _platform(setup) -> str:
  return setup.mesh.devices.flat[0].platform


def exchange_kind(setup) -> str:
  """How the dropless dispatch moves its blocks on the setup's devices."""
  return PADDED if _platform(setup) == 'cpu' else RAGGED


def ragged_dot_for(setup):
  """The dropless dispatch's grouped matmul on the setup's devices: XLA:CPU's ragged_dot
  multiplies every row by every group, so there the tiled one
  (engine/models/moe/tiled_ragged_dot.py) visits only the rows in groups; TPUs and GPUs compile
  ragged_dot to grouped-matmul kernels."""
  return tiled_ragged_dot.for_platform(_platform(setup))


def exchanges_dropless(setup, mode: str) -> bool:
  """Whether a layout's dropless dispatch over `expert` runs the exchange here: always in manual
  mode; in auto mode (inside a shard_map) where no pipeline's vmap surrounds the layers (there
  auto mode gives every position a slot)."""
  return mode == 'manual' or not setup.rules.mesh_axes('layers')


def _padded_swap(axis: str, n: int, R: int):
  """Block j of every device to device j, whole: [n R, ...] -> [n R, ...]."""
  def swap(v):
    return jax.lax.all_to_all(v.reshape(n, R, *v.shape[1:]), axis, 0, 0,
                              tiled=True).reshape(v.shape)
  return swap


def _ragged_moves(axis: str, n: int, R: int, sent_n: jax.Array, got_n: jax.Array):
  """(there, back): the padded swap's result, sending only the first sent_n[j] rows of each
  block j (the rest of the receiver's block stays zero), and the way back of the same rows."""
  starts = jnp.arange(n, dtype=jnp.int32) * R
  here = jnp.full((n,), jax.lax.axis_index(axis) * R, jnp.int32)  # Our block in every buffer.

  def move(v, send, receive):
    return jax.lax.ragged_all_to_all(v, jnp.zeros_like(v), starts, send, here, receive,
                                     axis_name=axis)
  return lambda v: move(v, sent_n, got_n), lambda v: move(v, got_n, sent_n)


def _experts_of_rows(got_nE: jax.Array, R: int) -> jax.Array:
  """[n R]: the local expert of each row of the received blocks, whose rows come sorted by
  expert, got_nE[s, e] of them from device s for expert e (E_here: an unused row)."""
  ends_nE = jnp.cumsum(got_nE, axis=1)
  rows_R = jnp.arange(R, dtype=jnp.int32)
  return (rows_R[None, :, None] >= ends_nE[:, None, :]).sum(-1).reshape(-1).astype(jnp.int32)


def dropless(x_TD: jax.Array, experts_TK: jax.Array, ffn: moe_dispatch.ExpertFFN,
             num_experts: int, axis: str, n: int, kind: str = PADDED) -> jax.Array:
  """[T, K, D]: every assignment's expert output, computed on the device holding the expert;
  `kind`: how the blocks travel (exchange_kind)."""
  T, K = experts_TK.shape
  E_here = num_experts // n
  R = T * min(K, E_here)
  experts_A = experts_TK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)
  expert_A = experts_A[order_A]
  device_A = expert_A // E_here
  sent_n = jnp.bincount(device_A, length=n).astype(jnp.int32)
  # Sorted by expert, hence by device: row a is row (a - first row for its device) of its block.
  row_A = device_A * R + jnp.arange(T * K) - (jnp.cumsum(sent_n) - sent_n)[device_A]
  send_xD = jnp.zeros((n * R, x_TD.shape[1]), x_TD.dtype).at[row_A].set(x_TD[order_A // K])
  if kind == RAGGED:  # Counts per (device, expert) go first; each row's expert follows from them.
    sent_nE = jnp.bincount(expert_A, length=num_experts).reshape(n, E_here).astype(jnp.int32)
    got_nE = jax.lax.all_to_all(sent_nE, axis, 0, 0, tiled=True)
    there, back = _ragged_moves(axis, n, R, sent_n, got_nE.sum(1))
    got_xD, got_expert = there(send_xD), _experts_of_rows(got_nE, R)
  else:
    there = back = _padded_swap(axis, n, R)
    send_expert = jnp.full((n * R,), E_here, jnp.int32).at[row_A].set(expert_A % E_here)
    got_xD, got_expert = there(send_xD), there(send_expert)
  # Here: rows from every device, each tagged with one of this device's experts (E_here: none).
  by_expert = jnp.argsort(got_expert, stable=True)
  sizes = jnp.bincount(got_expert, length=E_here + 1)[:E_here].astype(jnp.int32)
  y_here = ffn.grouped(got_xD[by_expert], sizes)
  y_here = jnp.where((got_expert[by_expert] < E_here)[:, None], y_here, 0)
  back_xD = back(y_here[jnp.argsort(by_expert)])
  return back_xD[row_A][jnp.argsort(order_A)].reshape(T, K, -1)
