"""`jax.lax.ragged_all_to_all` for XLA:CPU, which cannot run it: the same result (the primitive's
docstring's semantics) from an all_gather of every device's operand and arguments, so that CPU
tests can run the ragged expert exchange (engine/parallel/expert_exchange.py) and its gradient.
A test double, never used by the engine."""

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      *, axis_name, axis_index_groups=None):
  """Device s's rows [input_offsets[me], + send_sizes[me]) land in this device's `output` at
  s's output_offsets[me]; the rest of `output` is kept. recv_sizes must agree (checked by the
  callers' tests through the result)."""
  del recv_sizes, axis_index_groups
  operands = jax.lax.all_gather(operand, axis_name)  # [n, N, ...]
  starts, sizes, targets = (jax.lax.all_gather(a, axis_name)
                            for a in (input_offsets, send_sizes, output_offsets))
  me = jax.lax.axis_index(axis_name)
  rows = jnp.arange(output.shape[0])
  result = output
  for source in range(operands.shape[0]):
    first, size, target = starts[source, me], sizes[source, me], targets[source, me]
    lands = (rows >= target) & (rows < target + size)
    taken = operands[source][jnp.clip(first + rows - target, 0, operand.shape[0] - 1)]
    result = jnp.where(lands.reshape(-1, *[1] * (output.ndim - 1)), taken, result)
  return result
