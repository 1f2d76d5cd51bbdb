"""The zero-bubble pipeline schedule's split backward pass, for
engine/parallel/pipeline/one_f_one_b.py.

train.pipeline_schedule='zb_h1' (the ZB-H1 schedule of zero-bubble pipeline
parallelism, in lockstep ticks): 1F1B with each backward pass split in two
(engine/models/dense_taps.py). The input pass, in 1F1B's backward tick, recomputes the stage's
forward pass and takes its input's cotangent (which stage s - 1 waits for) and the gradients
of the parameters outside the projections; the weight pass takes the projections' weight
gradients from the projection inputs and output cotangents the input pass kept. No stage waits
for a weight pass, so every stage runs micro-batch m's in tick m + 2 S - 2, with stage 0's input
pass of m: the weight passes take M ticks instead of M + S - 1, and the S - 1 ticks in which
the backward passes start up the stages run without one. With a forward pass F, the input pass
2 F (its recomputation included) and the weight pass F, the bubble falls from 1F1B's
(S - 1) 4 F to (S - 1) 3 F (engine.parallel.pipeline.gpipe.bubble_fraction). The price: stage s
keeps s + 1 items' projection inputs and cotangents (a ring of S slots) besides 1F1B's stash.
Why this form: every stage runs a tick's passes in lockstep (auto mode's vmap over the stages
computes every branch of a per-stage choice), so a tick costs each pass any stage runs in it,
and of the three only the weight pass has no neighbour to wait for; aligning it across the
stages is what lockstep ticks can gain (ZB-V and the original ZB-H1 fill the bubble with
per-stage choices instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models import dense_taps
from engine.parallel.pipeline.carry_trees import floats, tree_add, with_floats
from engine.parallel.pipeline.stage_lanes import masked


class SplitBackward:
  """A stage's backward pass as the input pass and the weight pass, for the ticks of a
  one-chunk schedule (`ticks`: engine.parallel.pipeline.one_f_one_b's, for its cut, item order,
  stash and per-row inputs). Each stage keeps a ring of S slots of the items between their two
  passes."""

  def __init__(self, ticks):
    self.ticks, self.S = ticks, ticks.order.S

  def input_pass(self, t):
    """(stage s, its layers, its output's cotangent, its stash, its layers' gradient so far,
    its ring or None before the first) -> (that gradient with the parameters outside the
    projections added, its input's cotangent, the ring with the item's projection inputs and
    output cotangents in its slot)."""
    ticks = self.ticks

    def run(s, params, dy, stash, d_stage, ring):
      m, v, valid = ticks.order.backward_item(t, s)
      x, rows = ticks.stashed(stash, m, v), ticks.rows_of(m)
      recorded = jax.eval_shape(
          lambda p, x: ticks.cut.stage(p, x, rows, dense_taps.Taps(dense_taps.RECORD))[1],
          params, x)
      if ring is None:  # The last stage keeps S - 1 items waiting and the one of this tick.
        ring = jax.tree.map(lambda a: jnp.zeros((self.S, *a.shape), a.dtype),
                            (list(recorded[0]), list(recorded[1])))

      def stage(p, xf, taps):
        y, inputs = ticks.cut.stage(p, with_floats(x, xf), rows,
                                    dense_taps.Taps(dense_taps.INPUT, taps))
        return floats(y), list(inputs)
      _, stage_vjp, inputs = jax.vjp(stage, params, floats(x), dense_taps.zero_taps(recorded),
                                     has_aux=True)
      d_params, dx, d_taps = stage_vjp(dy)
      waiting = m % self.S
      ring = jax.tree.map(lambda r, new: jax.lax.dynamic_update_index_in_dim(r, jnp.where(
          valid, new, jax.lax.dynamic_index_in_dim(r, waiting, 0, keepdims=False)), waiting, 0),
                          ring, (inputs, list(d_taps)))
      return tree_add(d_stage, masked(valid, d_params)), dx, ring
    return run

  def weight_pass(self, m: int):
    """(stage s, its layers, its stash, its layers' gradient so far, its ring) -> that gradient
    with the projections' weight gradients of micro-batch m added (every stage's m: the same in
    a tick, m + 2 S - 2)."""
    ticks = self.ticks

    def run(s, params, stash, d_stage, ring):
      del s
      inputs, d_taps = jax.tree.map(lambda a: a[m % self.S], ring)
      # The layers run on some carry of the right types; only the projections' outputs on
      # the saved inputs are differentiated, the rest is dead code.
      carry = jax.tree.map(lambda a: a[0], stash)
      outputs = lambda p: list(ticks.cut.stage(
          p, carry, ticks.rows_of(m), dense_taps.Taps(dense_taps.WEIGHT, tuple(inputs)))[1])
      _, weights_vjp = jax.vjp(outputs, params)
      return tree_add(d_stage, weights_vjp(d_taps)[0])
    return run
