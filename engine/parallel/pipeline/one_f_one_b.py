"""The 1F1B pipeline schedule (one forward, one backward) and its interleaved form, in either
mode: the schedule takes the gradients itself, one stage and one micro-batch at a time, with
`jax.vjp`.

GPipe (engine/parallel/pipeline/gpipe.py) runs every micro-batch's forward pass before any backward
pass begins, and JAX's transpose of that loop keeps every micro-batch's activations alive until
then. Here, with S stages and M micro-batches, tick t (of M + 2S - 2) has stage s run

  the forward pass of micro-batch t - s, on what stage s - 1 sent at tick t - 1 (stage 0: the
    embedding of the micro-batch), and
  the backward pass of micro-batch t - (2S - 2 - s), with the cotangent stage s + 1 sent back at
    tick t - 1 (the last stage: its own output's, from the head and the loss in this tick),

each where that micro-batch exists: the first S - 1 ticks run forward passes only, the last
S - 1 backward passes only; those are the bubble, (S - 1) / (M + S - 1) of a step, as GPipe's.
In between, every stage runs one forward and one backward pass per tick: uniform SPMD work.

Interleaved (train.pipeline_repeats = V > 1; Megatron's interleaved 1F1B): the stack is cut
into S V chunks and stage s holds chunks s, s + S, ..., as the circular schedule lays them out,
so a micro-batch circles the stages V times. A stage's work items are (micro-batch, chunk)
pairs, in groups of S micro-batches: its forward item k is micro-batch (k // SV) S + k mod S at
chunk (k mod SV) // S, its backward item k the same micro-batch at the mirrored chunk, V - 1
minus that. Tick t (of M V + V S + S - 2) has stage s run forward item t - s and backward item
t - (V S + S - 2 - s); the last stage's output goes round to stage 0 for the next chunk (and
stage 0's input cotangent back round to the last stage), arriving in the next tick as item
order needs it. A tick costs 1 / V of a 1F1B tick: the bubble, (S - 1) / (V M + S - 1) of a
step, shrinks V-fold (M must be a multiple of S: whole groups).

Zero-bubble (train.pipeline_schedule='zb_h1'): this schedule with each backward pass split into
an input pass and a weight pass (engine/parallel/pipeline/zero_bubble.py).

A stage keeps each item's input from its forward pass to its backward pass, which recomputes the
forward pass under `jax.vjp` (the stage's remat policy applies there): at most min(M V,
2 V S - 1) inputs of [b, L, D] on a stage, not every micro-batch's activations. The price is one
more forward pass of the stage per micro-batch.

The model is cut at its layer stack (engine/parallel/pipeline/model_cut.py): each micro-batch is
embedded in the tick that feeds it to stage 0, and the embedding's gradient taken in the tick stage
0 finishes its backward pass (so neither the whole batch's embedding nor its cotangent is ever
alive; the embedding is a lookup, which every stage runs, uniform work). The
head and the loss run in every tick that finishes a micro-batch, split over the stages
(train.pipeline_head='split'): the last stage's output is dealt out, stage s takes the s-th of S
slices of its rows, or of its positions where the rows do not divide (head_axis), and runs them
with the micro-batch's auxiliary terms, which the last stage broadcasts; the loss is the mean of
the shares and the cotangents are gathered back to the last stage. The head, the largest matmul
of a large-vocabulary model, then costs each stage 1 / S of one micro-batch's instead of a whole
one (manual mode computed it on every stage, uniform SPMD work: the last stage's counted). Where
neither divides, or with 'last_stage', the last stage runs it alone (manual mode: every stage,
on its own output).

Manual mode holds one stage per device along the `stage` axis and shifts activations and
cotangents with `ppermute`; auto mode holds [S, ...] arrays sharded over `stage`, runs each stage
under `vmap`, and shifts by one along that dimension (a collective-permute after compilation):
engine/parallel/pipeline/stage_lanes.py.

Shape suffixes: S stages, V chunks per stage, M micro-batches, K stash slots, b micro-batch rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.parallel.pipeline.carry_trees import floats, tree_add, with_floats, zero_integers
from engine.parallel.pipeline.model_cut import ModelCut
from engine.parallel.pipeline.stage_lanes import Lanes, masked
from engine.parallel.steps import kept_count, next_token_loss, packed_documents, split_microbatches
from engine.parallel.pipeline.zero_bubble import SplitBackward


def stash_slots(stages: int, microbatches: int, chunks: int = 1) -> int:
  """How many items' inputs the first stage holds at most (the others fewer)."""
  return min(microbatches * chunks, 2 * chunks * stages - 1)


def ticks(stages: int, microbatches: int, chunks: int = 1) -> int:
  """The schedule's length: the last micro-batch's backward pass ends on stage 0 then."""
  return microbatches * chunks + chunks * stages + stages - 2


class ItemOrder:
  """Which (micro-batch, chunk) each stage works on when (the module docstring); plain integer
  arithmetic, so that indices may be Python ints (static: the tick's own phases) or traced (a
  stage's own, under shard_map or vmap)."""

  def __init__(self, stages: int, microbatches: int, chunks: int = 1):
    self.S, self.M, self.V = stages, microbatches, chunks
    self.items = microbatches * chunks
    self.ticks = ticks(stages, microbatches, chunks)

  def forward_item(self, t, stage):
    """Stage `stage`'s forward item at tick t: (micro-batch, chunk, whether it exists)."""
    return self._item(t - stage, mirrored=False)

  def backward_item(self, t, stage):
    """Stage `stage`'s backward item at tick t: (micro-batch, chunk, whether it exists)."""
    return self._item(t - (self.V * self.S + self.S - 2 - stage), mirrored=True)

  def forward_index(self, microbatch, chunk):
    """The forward item a stage runs micro-batch `microbatch` at chunk `chunk` as."""
    group = self.S * self.V
    return microbatch // self.S * group + chunk * self.S + microbatch % self.S

  def _item(self, k, mirrored: bool):
    group = self.S * self.V
    microbatch = k // group * self.S + k % self.S
    chunk = k % group // self.S
    return microbatch, (self.V - 1 - chunk) if mirrored else chunk, (k >= 0) & (k < self.items)


def step_loss(setup, ops, tokens_BL1):
  """(the train step's loss function (params, tokens, ops) -> (loss, statistics), which divides
  by each micro-batch's share of the packed documents' kept count, and the documents' per-row
  inputs of the layers or None): what both modes cut the model with. The loss takes
  `shares`: the head split over that many stages, each share's packed documents divide by
  1 / shares of the count."""
  eos_id, microbatches = setup.options.eos_id, setup.options.microbatches
  count = kept_count(ops, tokens_BL1, eos_id, microbatches)
  loss = lambda params, tokens, loss_ops, shares=1: next_token_loss(
      params, setup.graphdef, tokens, loss_ops, with_stats=True, eos_id=eos_id,
      count=None if count is None else count / shares, loss_chunks=setup.options.loss_chunks)
  rows = None if eos_id is None else packed_documents(ops, tokens_BL1, eos_id)[0].documents
  return loss, rows


class _Ticks:
  """What a stage does in tick t: its forward pass, its backward pass, and on the last stage
  the head and the loss (the module docstring)."""

  def __init__(self, cut: ModelCut, lanes: Lanes, order: ItemOrder, outer_params, outer_ops,
               tokens_BL1, rows, head_axis: int | None, split_backward: bool = False):
    self.cut, self.lanes, self.order, self.head_axis = cut, lanes, order, head_axis
    self.K = stash_slots(order.S, order.M, order.V)
    self.outer_params, self.outer_ops = outer_params, outer_ops
    self.tokens_MbL1 = split_microbatches(tokens_BL1, order.M)
    self.rows_M = None if rows is None else jax.tree.map(
        lambda a: split_microbatches(a, order.M), rows)
    self.split = SplitBackward(self) if split_backward else None

  def rows_of(self, m):
    """Micro-batch m's per-row inputs (m may be traced and outside [0, M): the bubble's)."""
    return None if self.rows_M is None else jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, m % self.order.M, 0, keepdims=False),
        self.rows_M)

  def chunk(self, params, v):
    """A stage's layers of chunk v ([V, ...] leaves; with one chunk, all of them)."""
    if self.order.V == 1:
      return params
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False), params)

  def add_to_chunk(self, d_stage, v, d_chunk):
    """d_stage with d_chunk added to chunk v's gradient."""
    if self.order.V == 1:
      return tree_add(d_stage, d_chunk)
    return jax.tree.map(lambda acc, d: jax.lax.dynamic_update_index_in_dim(
        acc, jax.lax.dynamic_index_in_dim(acc, v, 0, keepdims=False) + d, v, 0), d_stage, d_chunk)

  def forward(self, t):
    """(stage s, its layers, its input, its stash) -> (its output, the stash with the input
    kept in its forward item's slot)."""
    def run(s, params, x, stash):
      m, v, valid = self.order.forward_item(t, s)
      y = self.cut.stage(self.chunk(params, v), x, self.rows_of(m))
      slot = self.order.forward_index(m, v) % self.K
      kept = jax.tree.map(lambda new, old: jnp.where(
          valid, new, jax.lax.dynamic_index_in_dim(old, slot, 0, keepdims=False)), x, stash)
      stash = jax.tree.map(lambda s_, k: jax.lax.dynamic_update_index_in_dim(s_, k, slot, 0),
                           stash, kept)
      return y, stash
    return run

  def stashed(self, stash, m, v):
    """Item (m, v)'s input, as the stash holds it since its forward pass."""
    slot = self.order.forward_index(m, v) % self.K
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=False),
                        stash)

  def backward(self, t):
    """(stage s, its layers, its output's cotangent, its stash, its layers' gradient so far) ->
    (that gradient with its backward item's added, its input's cotangent); the forward pass
    recomputed."""
    def run(s, params, dy, stash, d_stage):
      m, v, valid = self.order.backward_item(t, s)
      x = self.stashed(stash, m, v)
      through = lambda p, xf: floats(self.cut.stage(p, with_floats(x, xf), self.rows_of(m)))
      _, stage_vjp = jax.vjp(through, self.chunk(params, v), floats(x))
      d_params, dx = stage_vjp(dy)
      return self.add_to_chunk(d_stage, v, masked(valid, d_params)), dx
    return run

  def backward_tick(self, t, stage_params, dy, stash, d_stage, ring):
    """Every stage's backward pass of tick t: (their layers' gradient so far with it added,
    their inputs' cotangents, the zero-bubble schedule's ring). Split (zero-bubble): the input
    pass, then every stage's weight pass of the micro-batch stage 0's input pass just ran."""
    lanes = self.lanes
    if self.split is None:
      d_stage, dx = lanes.map(self.backward(t), stage_params, dy, stash, d_stage)
      return d_stage, lanes.pin(dx), ring
    d_stage, dx, ring = lanes.map(self.split.input_pass(t), stage_params, dy, stash, d_stage,
                                  ring)
    m = t - (2 * self.order.S - 2)
    if 0 <= m < self.order.M:
      d_stage = lanes.map(self.split.weight_pass(m), stage_params, stash, d_stage, ring)
    return d_stage, lanes.pin(dx), ring

  def head(self, m: int, y):
    """(the loss / M of micro-batch m, which the last stage finished in this tick, its
    statistics / M, the gradient of the outer parameters, the cotangent of y): from y, the
    stages' outputs as the lanes hold them. Split, each stage runs the head on 1 / S of the
    last stage's output (rows or positions: head_axis; manual mode: each result its share, the
    caller sums them); else the last stage on all of it."""
    lanes, S, M = self.lanes, self.order.S, self.order.M
    last, tokens = lanes.of_stage(y, S - 1), self.tokens_MbL1[m]

    def whole(params, last_floats):
      return self.cut.head(params, with_floats(last, last_floats), tokens, self.outer_ops)

    def split(params, last_floats):
      # Stage s's share: its slice's loss (packed documents: their sum over 1 / S of the count)
      # with the micro-batch's auxiliary terms; the mean over the stages is the loss.
      x, extras = _x_and_extras(with_floats(last, last_floats))
      extras = lanes.broadcast_from(S - 1, extras)
      share = lambda s, x_s, tokens_s: self.cut.head(
          params, _carry(x_s, extras), tokens_s, self.outer_ops, shares=S)
      loss, stats = lanes.total(lanes.map(share, lanes.deal_out(S - 1, x, self.head_axis),
                                          lanes.own_tokens(tokens, self.head_axis)))
      return loss / S, jax.tree.map(lambda a: a / S, stats)

    split_head = self.head_axis is not None
    (loss, stats), head_vjp = jax.vjp(split if split_head else whole, self.outer_params,
                                      floats(last))
    d_params, dy = head_vjp((jnp.ones_like(loss) / M, jax.tree.map(jnp.zeros_like, stats)))
    result = loss / M, jax.tree.map(lambda a: a / M, stats), d_params
    return (*(result if split_head else lanes.only_on(S - 1, result)), dy)


def _x_and_extras(carry):
  """A carry's activations x [b, L, D] and the extras that ride with them (or None)."""
  return carry if isinstance(carry, tuple) else (carry, None)


def _carry(x, extras):
  return x if extras is None else (x, extras)


def head_axis(one, tokens_bL1, lanes: Lanes, head: str) -> int | None:
  """Along which axis of a micro-batch's output `one` the head is split over the stages
  (train.pipeline_head='split'): 0, its rows, where each stage's share still splits over the
  lanes' row ways; else 1, its positions, where they divide and the layout keeps each
  sequence whole (x's length is tokens_bL1's [b, L + 1] less one); else None, the last stage
  runs it."""
  if head != 'split':
    return None
  x, stages = _x_and_extras(one)[0], lanes.stages
  if x.shape[0] % (stages * lanes.row_ways) == 0:
    return 0
  if (lanes.positions_split and x.shape[1] % stages == 0 and
      x.shape[1] + 1 == tokens_bL1.shape[1]):
    return 1
  return None


def one_f_one_b(cut: ModelCut, lanes: Lanes, outer_params, stage_params, tokens_BL1,
                microbatches: int, outer_ops, rows=None, chunks: int = 1, head: str = 'split',
                split_backward: bool = False):
  """(the mean loss over the micro-batches, their mean statistics, the gradients of the mean
  loss w.r.t. `outer_params` (everything but the stacked layers; the stacked subtree zeros),
  those w.r.t. `stage_params` (each stage's layers, as `lanes` holds them; with `chunks` > 1,
  interleaved, [chunks, ...] per stage)).

  `outer_params` feed the embedding and the head (with `outer_ops`); `rows`: per-row inputs of
  the layers (packed documents' segments and positions, [B, L] each), or None; `head`:
  train.pipeline_head (head_axis); `split_backward`: the zero-bubble schedule (one chunk).
  Manual mode: every result is this device's, to be summed over the stages by the caller."""
  S, M, circle = lanes.stages, microbatches, chunks > 1
  order = ItemOrder(S, M, chunks)
  embeddings = _Embeddings(cut, outer_params, split_microbatches(tokens_BL1, M), outer_ops)
  one = embeddings.item(0)  # Micro-batch 0's carry: the shapes every tick moves.
  ticks_of = _Ticks(cut, lanes, order, outer_params, outer_ops, tokens_BL1, rows,
                    head_axis(one, tokens_BL1, lanes, head), split_backward)
  x = lanes.where_stage(0, one, lanes.zeros(one))
  stash = lanes.zeros(jax.tree.map(lambda a: jnp.zeros((ticks_of.K, *a.shape), a.dtype), one),
                      True)
  dy = lanes.zeros(floats(one))
  d_stage = jax.tree.map(jnp.zeros_like, stage_params)
  d_outer, loss, stats, ring = None, 0.0, None, None
  # The ticks in which some stage has a forward (backward) pass to run.
  forward_ticks = range(order.items + S - 1)
  backward_ticks = range(order.ticks - (order.items + S - 1), order.ticks)
  for t in range(order.ticks):
    if t in forward_ticks:
      y, stash = lanes.map(ticks_of.forward(t), stage_params, x, stash)
      y, stash = lanes.pin(y), lanes.pin(stash, stash=True)
      m, v, valid = order.forward_item(t, S - 1)
      if valid and v == chunks - 1:  # The last stage finished a micro-batch: loss, cotangent.
        loss_m, stats_m, d_head, dy_last = ticks_of.head(m, y)
        loss = loss + loss_m
        stats = stats_m if stats is None else tree_add(stats, stats_m)
        d_outer = d_head if d_outer is None else tree_add(d_outer, d_head)
        dy = lanes.where_stage(S - 1, dy_last, dy)
    if t in backward_ticks:
      d_stage, dx, ring = ticks_of.backward_tick(t, stage_params, dy, stash, d_stage, ring)
      m, v, valid = order.backward_item(t, 0)
      if valid and v == 0:  # Stage 0 finished a micro-batch's backward pass: its embedding's.
        d_embed = embeddings.gradient(m, lanes.only_on(0, lanes.of_stage(dx, 0))[0])
        d_outer = d_embed if d_outer is None else tree_add(d_outer, d_embed)
      dy = lanes.to_previous(dx, circle)
    if t + 1 in forward_ticks:
      m, v, valid = order.forward_item(t + 1, 0)
      first = (one if m == 0 else embeddings.item(m)) if valid and v == 0 else (
          None if circle else jax.tree.map(jnp.zeros_like, one))
      x = lanes.to_next(y, first, circle)
  return loss, stats, d_outer, d_stage


class _Embeddings:
  """Each micro-batch's stack input, embedded in the tick that first feeds it to stage 0, and
  the embedding's gradient, taken in the tick stage 0 finishes its backward pass: one
  micro-batch's embedding and its cotangent alive at a time, not the whole batch's."""

  def __init__(self, cut: ModelCut, outer_params, tokens_MbL1, ops):
    self.cut, self.outer_params, self.tokens_MbL1, self.ops = cut, outer_params, tokens_MbL1, ops
    self.vjps = {}

  def item(self, m: int):
    carry, vjp = jax.vjp(lambda p: self.cut.embed(p, self.tokens_MbL1[m], self.ops),
                         self.outer_params)
    self.vjps[m] = vjp, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), carry)
    return carry

  def gradient(self, m: int, d_x):
    """The gradient of the outer parameters from micro-batch m's stack input's cotangent d_x.
    The extras every micro-batch starts from are the model's constants (zeros it adds its
    layers' terms to): nothing to differentiate."""
    vjp, carry = self.vjps.pop(m)
    d_extras = [jnp.zeros(a.shape, a.dtype) for a in floats(carry)[1:]]
    return vjp(zero_integers(with_floats(carry, [d_x] + d_extras)))[0]
