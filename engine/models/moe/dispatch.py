"""Moving a mixture of experts' token-assignments to their experts and back, on one device.

The layer (engine/models/moe/layer.py) routes every token to K experts and hands the assignments to
`ops.experts`, whose plain version (LocalOps) is one of the two dispatches here; the parallel
modes rearrange the same steps around an exchange between the devices that hold the experts
(engine/parallel/auto.py: sharding constraints; engine/parallel/expert_exchange.py: all_to_all).

- dropless: the assignments sorted by expert (stable: token order inside an expert) and
  multiplied with grouped matmuls (`ExpertFFN.grouped`, jax.lax.ragged_dot), then unsorted.
- capacity: every sequence is a group (GShard's): each expert takes at most C assignments of it,
  the first ones in (position, choice) order; later ones are dropped and contribute zero. The
  kept ones are scattered into a buffer [E, B, C, D] and multiplied expert by expert
  (`ExpertFFN.batched`). Drops depend only on the sequence, never on how the batch is split
  over devices or micro-batches, so every layout drops exactly what one device drops.

Shape suffixes: B sequences, L length, T tokens, K choices per token, A assignments (T * K or
L * K per sequence), E experts, C slots per expert and sequence, D embed, F expert hidden.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from engine.models import quantized_matmul


@dataclasses.dataclass(frozen=True)
class ExpertFFN:
  """The SwiGLU experts whose weights this device holds (leading dimension: its experts), as
  the two products the dispatches need; `finish` ends the down projection's contraction over
  the expert hidden dimension (a tensor-parallel layout psums it there)."""
  w_gate_EDF: jax.Array
  w_up_EDF: jax.Array
  w_down_EFD: jax.Array
  finish: Callable[[jax.Array], jax.Array]
  # How `batched` multiplies (model.matmul_precision, for the capacity dispatch).
  precision: quantized_matmul.MatmulPrecision = quantized_matmul.DEFAULT
  # How `grouped` multiplies: jax.lax.ragged_dot, or on CPU engine/models/moe/tiled_ragged_dot.py.
  ragged_dot: Callable = jax.lax.ragged_dot

  @property
  def num_experts(self) -> int:
    return self.w_gate_EDF.shape[0]

  def grouped(self, x_AD: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """Rows sorted by expert, group_sizes_E rows each; rows past their sum give zeros."""
    gate_AF = self.ragged_dot(x_AD, self.w_gate_EDF, group_sizes_E)
    up_AF = self.ragged_dot(x_AD, self.w_up_EDF, group_sizes_E)
    y_AD = self.ragged_dot(jax.nn.silu(gate_AF) * up_AF, self.w_down_EFD, group_sizes_E)
    return self.finish(y_AD)

  def batched(self, x_ENC: jax.Array) -> jax.Array:
    """[E, N, D] -> [E, N, D]: row block e through expert e (zero rows stay zero)."""
    if self.precision.quantized:
      product = functools.partial(quantized_matmul.batched_matmul, precision=self.precision)
    else:
      product = lambda x, w: jnp.einsum('enk,ekf->enf', x, w)
    gate, up = product(x_ENC, self.w_gate_EDF), product(x_ENC, self.w_up_EDF)
    return self.finish(product(jax.nn.silu(gate) * up, self.w_down_EFD))


def capacity(length: int, k: int, experts: int, factor: float) -> int:
  """Slots per expert and sequence of the capacity dispatch: C = ceil(L * K / E * factor)."""
  return max(1, math.ceil(length * k / experts * factor))


def dropless(x_TD: jax.Array, experts_TK: jax.Array, ffn: ExpertFFN) -> jax.Array:
  """[T, K, D]: every assignment's expert output, by grouped matmuls over sorted rows."""
  T, K = experts_TK.shape
  experts_A = experts_TK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)  # Assignments grouped by expert.
  group_sizes_E = jnp.bincount(experts_A, length=ffn.num_experts).astype(jnp.int32)
  y_AD = ffn.grouped(x_TD[order_A // K], group_sizes_E)
  return y_AD[jnp.argsort(order_A)].reshape(T, K, -1)  # Back to (token, choice) order.


def sequence_slots(experts_BLK: jax.Array, num_experts: int, slots: int):
  """(slot [B, A] in [0, E * C), or E * C for a dropped assignment; kept [B, A] bool).
  Assignment a = l * K + i of a sequence takes its expert's next free slot in that sequence."""
  B = experts_BLK.shape[0]
  experts_BA = experts_BLK.reshape(B, -1)
  onehot_BAE = jax.nn.one_hot(experts_BA, num_experts, dtype=jnp.int32)
  taken_BAE = jnp.cumsum(onehot_BAE, axis=1) - 1
  position_BA = jnp.take_along_axis(taken_BAE, experts_BA[..., None], axis=2)[..., 0]
  kept_BA = position_BA < slots
  return jnp.where(kept_BA, experts_BA * slots + position_BA, num_experts * slots), kept_BA


def to_slots(x_BLD: jax.Array, slot_BA: jax.Array, num_experts: int, slots: int) -> jax.Array:
  """[E, B, C, D]: each kept assignment's token in its slot, zeros in the empty slots."""
  B, L, D = x_BLD.shape
  K = slot_BA.shape[1] // L

  def one_sequence(x_LD, slot_A):
    rows_AD = jnp.repeat(x_LD, K, axis=0)  # Assignment a = l * K + i reads token l.
    return jnp.zeros((num_experts * slots, D), x_LD.dtype).at[slot_A].set(rows_AD, mode='drop')

  x_BSD = jax.vmap(one_sequence)(x_BLD, slot_BA)
  return x_BSD.reshape(B, num_experts, slots, D).swapaxes(0, 1)


def from_slots(y_EBCD: jax.Array, slot_BA: jax.Array, k: int) -> jax.Array:
  """[B, L, K, D]: each assignment's expert output, zero for a dropped one."""
  E, B, C, D = y_EBCD.shape
  y_BSD = y_EBCD.swapaxes(0, 1).reshape(B, E * C, D)
  take = lambda y_SD, slot_A: jnp.take(y_SD, slot_A, axis=0, mode='fill', fill_value=0)
  return jax.vmap(take)(y_BSD, slot_BA).reshape(B, -1, k, D)


def with_capacity(x_BLD, experts_BLK, ffn: ExpertFFN, num_experts: int, slots: int,
                  exchange=lambda x_EBCD, fn: fn(x_EBCD)):
  """([B, L, K, D] expert outputs, zero where dropped; the fraction of assignments dropped).
  `exchange(x_EBCD, fn)` applies `fn` ([E_here, X, C, D] -> the same) to the experts' buffer: a
  layout that splits the experts moves the buffer to them and back around it."""
  K = experts_BLK.shape[-1]
  slot_BA, kept_BA = sequence_slots(experts_BLK, num_experts, slots)
  x_EBCD = to_slots(x_BLD, slot_BA, num_experts, slots)

  def through_experts(x_EXCD):
    E_here, X, C, D = x_EXCD.shape
    return ffn.batched(x_EXCD.reshape(E_here, X * C, D)).reshape(E_here, X, C, D)

  y_BLKD = from_slots(exchange(x_EBCD, through_experts), slot_BA, K)
  return y_BLKD, 1.0 - kept_BA.astype(jnp.float32).mean()
