"""How a mode holds one value per pipeline stage, for the 1F1B schedules
(engine/parallel/pipeline/one_f_one_b.py), which are written once against these operations.

`Lanes`, manual mode: one stage per device along the `stage` axis inside shard_map; a value is
the device's own, shifts are `ppermute`s and sums over stages collectives. `StackedLanes`, auto
mode: [S, ...] arrays laid out over `stage`, each stage run under `vmap`, shifts by one along
that dimension (a collective-permute after compilation).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def masked(valid, tree):
  """`tree` where `valid`, zeros elsewhere."""
  return jax.tree.map(lambda g: jnp.where(valid, g, jnp.zeros_like(g)), tree)


class Lanes:
  """How a mode holds one value per stage: the manual version, a device's own stage."""

  # The ways a micro-batch's rows are split within a stage (auto mode's batch axes: a split
  # head's slices must keep them), and whether its positions may be split (not where a
  # context axis splits them).
  row_ways, positions_split = 1, True

  def __init__(self, axis: str, stages: int):
    self.axis, self.stages = axis, stages

  def stage_index(self):
    return jax.lax.axis_index(self.axis)

  def map(self, fn: Callable, *args):
    """fn(stage index, *the stage's args), for every stage."""
    return fn(self.stage_index(), *args)

  def to_next(self, tree, first, ring: bool = False):
    """Stage s + 1 gets stage s's value; stage 0 gets `first`, or with `first` None and `ring`
    the last stage's value."""
    pairs = [(i, (i + 1) % self.stages) for i in range(self.stages if ring else self.stages - 1)]
    shifted = jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis, pairs), tree)
    return shifted if first is None else self.where_stage(0, first, shifted)

  def to_previous(self, tree, ring: bool = False):
    """Stage s - 1 gets stage s's value; the last stage zeros, or with `ring` stage 0's."""
    pairs = [((i + 1) % self.stages, i) for i in range(self.stages if ring else self.stages - 1)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, self.axis, pairs), tree)

  def where_stage(self, stage: int, value, others):
    """`value` on stage `stage` (a value of one stage), `others` elsewhere."""
    on = self.stage_index() == stage
    return jax.tree.map(lambda v, o: jnp.where(on, v, o), value, others)

  def of_stage(self, tree, stage: int):
    """Stage `stage`'s value (manual: this device's own, meaningful on that stage)."""
    del stage
    return tree

  def only_on(self, stage: int, tree):
    """A value computed from of_stage(..., stage), kept where it is meaningful: manual mode
    zeros it on the other stages (they computed it on their own values)."""
    return masked(self.stage_index() == stage, tree)

  def zeros(self, tree, stash: bool = False):
    """Zeros for every stage, shaped like one stage's `tree`."""
    del stash
    return jax.tree.map(jnp.zeros_like, tree)

  def deal_out(self, stage: int, x, axis: int):
    """Stage `stage`'s x [b, L, ...] dealt out along `axis` (0: rows, 1: positions): stage s
    gets the s-th of S equal slices (a reduce-scatter of x, zeros on the other stages)."""
    on = self.stage_index() == stage
    return jax.lax.psum_scatter(jnp.where(on, x, jnp.zeros_like(x)), self.axis,
                                scatter_dimension=axis, tiled=True)

  def own_tokens(self, tokens_bL1, axis: int):
    """Each stage's tokens for its slice of deal_out's: its 1 / S of the rows, or its positions'
    1 / S of the length and the one token after them (the last one's target)."""
    n = (tokens_bL1.shape[axis] - axis) // self.stages
    return jax.lax.dynamic_slice_in_dim(tokens_bL1, self.stage_index() * n, n + axis, axis)

  def broadcast_from(self, stage: int, tree):
    """Stage `stage`'s value on every stage."""
    on = self.stage_index() == stage
    return jax.tree.map(lambda a: jax.lax.psum(jnp.where(on, a, jnp.zeros_like(a)), self.axis),
                        tree)

  def total(self, tree):
    """The sum over the stages of per-stage values (manual mode: the caller's psum sums)."""
    return tree

  def pin(self, tree, stash: bool = False):
    """Lays out a tree of per-stage values (auto mode's; manual values are local)."""
    del stash
    return tree


class StackedLanes(Lanes):
  """Auto mode: [S, ...] arrays, the stages run under `vmap` (`pin` lays one out)."""

  def __init__(self, stages: int, pin_x: Callable, pin_other: Callable, pin_rows: Callable,
               row_ways: int = 1, positions_split: bool = True):
    super().__init__('stage', stages)
    self.pin_x, self.pin_other, self.pin_rows = pin_x, pin_other, pin_rows
    self.row_ways, self.positions_split = row_ways, positions_split

  def pin(self, tree, stash: bool = False):
    """A carry-like tree of [S, ...] arrays (its first leaf x, [S, b, L, D], or with `stash`
    [S, K, b, L, D]) laid out over `stage`, x's other dimensions by the rules."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [self.pin_x(leaves[0], stash)] + [
        self.pin_other(a) for a in leaves[1:]])

  def stage_index(self):
    return jnp.arange(self.stages)

  def map(self, fn, *args):
    return jax.vmap(fn, spmd_axis_name='stage')(self.stage_index(), *args)

  def to_next(self, tree, first, ring=False):
    last = lambda a: a[-1:] if ring else jnp.zeros_like(a[:1])
    shifted = self.pin(jax.tree.map(lambda a: jnp.concatenate([last(a), a[:-1]]), tree))
    return shifted if first is None else self.where_stage(0, first, shifted)

  def to_previous(self, tree, ring=False):
    first = lambda a: a[:1] if ring else jnp.zeros_like(a[:1])
    return self.pin(jax.tree.map(lambda a: jnp.concatenate([a[1:], first(a)]), tree))

  def where_stage(self, stage, value, others):
    return self.pin(jax.tree.map(lambda v, o: o.at[stage].set(v), value, others))

  def of_stage(self, tree, stage):
    return jax.tree.map(lambda a: a[stage], tree)

  def only_on(self, stage, tree):
    del stage
    return tree

  def zeros(self, tree, stash=False):
    return self.pin(jax.tree.map(lambda a: jnp.zeros((self.stages, *a.shape), a.dtype), tree),
                    stash)

  def deal_out(self, stage, x, axis):
    del stage
    slices = jnp.moveaxis(x.reshape(*x.shape[:axis], self.stages, -1, *x.shape[axis + 1:]),
                          axis, 0)
    return self.pin_x(slices, False)

  def own_tokens(self, tokens_bL1, axis):
    n = (tokens_bL1.shape[axis] - axis) // self.stages
    return self.pin_rows(jnp.stack([jax.lax.slice_in_dim(tokens_bL1, s * n, (s + 1) * n + axis,
                                                         axis=axis)
                                    for s in range(self.stages)]))

  def broadcast_from(self, stage, tree):
    del stage  # One stage's value: every stage's under `map`.
    return tree

  def total(self, tree):
    return jax.tree.map(lambda a: a.sum(0), tree)
