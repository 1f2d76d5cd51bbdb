"""A layer stack's backward pass in two halves: the input gradient now, the weight gradient later.

A zero-bubble pipeline schedule (engine/parallel/pipeline/one_f_one_b.py) runs a stage's backward
pass as two passes: one that carries the cotangent back to the stage's input (which the stage before
it waits for) and one that takes the weights' gradients (which nobody waits for, so it can run
whenever the schedule has room). Every projection of a layer is an `engine.models.layers.dense`
x @ w, whose weight gradient is x^T dy: what the second pass needs is each projection's input x
and its output's cotangent dy. `apply_layers` runs each layer under a `Taps` value that says how
its `dense` calls behave:

  RECORD  y = x @ w; the stack also returns the calls' inputs and outputs: their shapes, for
          the others.
  INPUT   y = x @ stop_gradient(w) + tap, with a zero `tap` per call, an input of the pass: its
          cotangent is dy. The pass's gradient reaches the stage's input and every parameter
          outside the projections (norm scales, biases, experts' weights), not the projections'
          weights; the stack also returns the calls' inputs (each once: q, k and v projections
          of one x share it).
  WEIGHT  y = stop_gradient(x_saved) @ w, on the x the input pass returned; the stack returns
          every y. Their vjp with the input pass's dy is exactly the projections' weight
          gradients (whatever the layout does to w on the way, a cast or a gather, is
          transposed with it), and nothing else: the rest of the layer is dead code, and each
          layer hands its input on unchanged, so that a scanned stack drops it too.

The two passes' gradients add up to the whole backward pass's. The calls of a layer are matched
by their order, which a layer's trace fixes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

RECORD, INPUT, WEIGHT = 'record', 'input', 'weight'


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Taps:
  """How a layer's `dense` calls behave (the module docstring), with one value per call: INPUT's
  zero taps, WEIGHT's saved inputs; RECORD's none. A pytree whose mode is static, so that a scan
  traced for one mode is never reused for another."""
  mode: str = dataclasses.field(metadata=dict(static=True))
  values: tuple = ()


class _Layer:
  """One layer's trace under `taps`: hands out its values call by call and keeps what the
  stack returns. Calls on the same input (a query, key and value projection of one normed x)
  keep it once: the passes trace the same code, so they see the same calls share it."""

  def __init__(self, taps: Taps):
    self.taps, self.calls = taps, 0
    self.inputs, self.input_index, self.outputs = [], {}, []

  def dense(self, x, w, matmul: Callable):
    i, mode = self.calls, self.taps.mode
    self.calls += 1
    if id(x) not in self.input_index:
      self.input_index[id(x)] = len(self.inputs)
      self.inputs.append(x)
    if mode == RECORD:
      y = matmul(x, w)
    elif mode == INPUT:
      y = matmul(x, jax.lax.stop_gradient(w)) + self.taps.values[i]
    else:
      y = matmul(jax.lax.stop_gradient(self.taps.values[self.input_index[id(x)]]), w)
    self.outputs.append(y)
    return y

  def returned(self) -> tuple:
    """RECORD: (the distinct inputs, every output); INPUT: the distinct inputs; WEIGHT: every
    output."""
    inputs, outputs = tuple(self.inputs), tuple(self.outputs)
    return {RECORD: (inputs, outputs), INPUT: inputs, WEIGHT: outputs}[self.taps.mode]


_ACTIVE: list[_Layer] = []


def dense_call(x, w, matmul: Callable):
  """`matmul(x, w)` as the innermost active layer's taps have it (plain outside any)."""
  return _ACTIVE[-1].dense(x, w, matmul) if _ACTIVE else matmul(x, w)


def tapped(apply: Callable) -> Callable:
  """`apply(layer, x)` -> `(layer, x, taps)` -> (its result, what the taps' mode returns per
  dense call, in call order)."""
  def run(layer, x, taps: Taps):
    _ACTIVE.append(_Layer(taps))
    try:
      y = apply(layer, x)
    finally:
      layer_trace = _ACTIVE.pop()
    if taps.mode == WEIGHT:
      # The layer's own output is dead code: passing the input on instead lets the compiler
      # drop it from a scanned stack too (a loop's carry is live).
      y = x
    return y, layer_trace.returned()
  return run


def zero_taps(recorded) -> tuple:
  """INPUT's zero taps, shaped (and, under shard_map, varying over the mesh axes) like the
  outputs of the RECORD pass's `recorded` (jax.eval_shape's, stacked per layer)."""
  def zeros(y):
    z = jnp.zeros(y.shape, y.dtype)
    manual = getattr(y, 'manual_axis_type', None)
    varying = tuple(sorted(manual.varying)) if manual is not None else ()
    return jax.lax.pcast(z, varying, to='varying') if varying else z
  return tuple(zeros(y) for y in recorded[1])
