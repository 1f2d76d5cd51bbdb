"""Pipeline parallelism: the stacked layers split into `stage` groups of consecutive layers, the
batch into micro-batches that flow from stage to stage.

GPipe (train.pipeline_repeats = 1): iteration t (of microbatches + stages - 1) stage 0 takes
micro-batch t, every other stage what its predecessor produced at t - 1; each stage applies its
own L / stages layers; the last stage's output is micro-batch t - (stages - 1)'s. A stage idles
for stages - 1 of the iterations: the bubble.

Circular (pipeline_repeats = R > 1; MaxText's circular schedule: Megatron's interleaved one in
GPipe's order): the stack is R groups of consecutive layers (engine.models.layers.group_layers),
every group split over the stages, so stage s holds slices s, s + S, s + 2S, ... of the depth, L /
(S R) layers each. A micro-batch circles the stages R times: the last stage's output returns to
stage 0 (kept there until its turn, microbatches - stages iterations later) for the next group.
Stage s works on item k = t - s, micro-batch k mod M of group k // M; R M + S - 1 iterations of L /
(S R) layers each: the bubble, (S - 1) / (R M + S - 1) of the step, shrinks R-fold in time, for R
times the permutes.

A carry (x, extras) (the training loss's auxiliary terms and router statistics, which every
layer adds to) flows with its micro-batch: each micro-batch starts from `extras`, the bubble's
iterations never reach the output, and the finished micro-batches' extras are averaged.

Per-row inputs `rows` (packed documents' segment ids and positions, [B, ...] each) are split
into micro-batches like x; whatever micro-batch a stage works on, `run(layers, state, rows)`
gets its rows (item k's, micro-batch k mod M: any in the bubble, whose output is never used;
None without rows).

The backward pass runs the schedule in reverse (JAX's transpose of the forward loop). Only the
stacked layers are pipelined. The embedding before them and the head and loss after them run on
every stage (their parameters are replicated over `stage`), on the last stage's output, which
is broadcast to all stages (manual: a masked psum; auto: the compiler's choice).

Manual mode shifts activations to the next stage with `ppermute` inside shard_map; auto mode
expresses the same schedule on a [stages, ...] array sharded over `stage` (its other dimensions,
and each stage's parameters, laid out by the rules), shifted by one along it each iteration,
which the compiler turns into a collective-permute.

Shape suffixes: M micro-batches, S stages, B batch (b = B / M), L length, D embed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.layers import layer_group, num_groups
from engine.parallel.steps import split_microbatches
from engine.sharding import logical_axes_of


# train.pipeline_schedule: '' picks GPipe, or the circular schedule when train.pipeline_repeats
# > 1; each named one says which it is.
SCHEDULES = ('gpipe', 'circular', '1f1b', 'interleaved_1f1b', 'zb_h1')
# How reports name them.
SCHEDULE_NAMES = {'gpipe': 'GPipe', 'circular': 'circular', '1f1b': '1F1B',
                  'interleaved_1f1b': 'interleaved 1F1B', 'zb_h1': 'zero-bubble (ZB-H1)'}
# The schedules that take each stage's gradients themselves
# (engine/parallel/pipeline/one_f_one_b.py) rather than leaving the backward pass to JAX's transpose
# of the forward loop.
SELF_DIFFERENTIATING = ('1f1b', 'interleaved_1f1b', 'zb_h1')
# train.pipeline_head: where those schedules run the head (engine/parallel/pipeline/one_f_one_b.py).
HEAD_PLACEMENTS = ('split', 'last_stage')


def schedule_of(train_config) -> str:
  """The schedule a train config asks for (engine.validation checks the combination)."""
  named = train_config.get('pipeline_schedule', '')
  if named:
    return named
  return 'circular' if train_config.pipeline_repeats > 1 else 'gpipe'


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1,
                    schedule: str = '') -> float:
  """The fraction of a step each stage spends idle (repeats > 1: the circular schedule).

  zb_h1 (engine/parallel/pipeline/one_f_one_b.py) counts its passes: a forward pass F, an input pass
  (the forward recomputed, then the input gradient) 2 F, a weight pass F; the M weight passes
  run in M ticks, not M + S - 1, so of 3 (M + S - 1) + M, 3 (S - 1) is idle."""
  if schedule == 'zb_h1':
    return 3 * (stages - 1) / (4 * microbatches + 3 * (stages - 1))
  return (stages - 1) / (repeats * microbatches + stages - 1)


class _Schedule:
  """Which work item each stage holds at each iteration, for both modes (see the docstring)."""

  def __init__(self, stages: int, microbatches: int, repeats: int):
    self.stages, self.microbatches, self.repeats = stages, microbatches, repeats
    self.iterations = repeats * microbatches + stages - 1

  def group(self, t, stage):
    """The layer group stage `stage` (an int, or traced) applies at iteration t (clamped in the
    bubble)."""
    if isinstance(stage, int):
      return min(max((t - stage) // self.microbatches, 0), self.repeats - 1)
    return jnp.clip((t - stage) // self.microbatches, 0, self.repeats - 1)

  def finished(self, t: int) -> int:
    """The item the last stage finishes at iteration t: r * M + m (group r, micro-batch m)."""
    return t - (self.stages - 1)

  def is_output(self, t: int) -> bool:
    """Whether the last stage finishes a micro-batch's final group at iteration t."""
    return self.finished(t) >= (self.repeats - 1) * self.microbatches

  def returns_at(self, t: int) -> int | None:
    """The iteration at which stage 0 takes back what the last stage finishes at t (its next
    group), or None."""
    done = self.finished(t)
    return done + self.microbatches if 0 <= done < (self.repeats - 1) * self.microbatches else None


def whole_batch(x_MbLD: jax.Array) -> jax.Array:
  """The inverse of split_microbatches."""
  return x_MbLD.swapaxes(0, 1).reshape(-1, *x_MbLD.shape[2:])


def microbatch_items(carry, microbatches: int) -> list:
  """The schedule's inputs, one per micro-batch: x's slice, or for a carry (x, extras) (the
  training loss's auxiliary terms: engine.models.llama.model.Block) (x's slice, extras): each
  micro-batch starts from `extras` and gathers its own layers' terms on its way through."""
  x_BLD, extras = carry if isinstance(carry, tuple) else (carry, None)
  x_MbLD = split_microbatches(x_BLD, microbatches)
  return [x_MbLD[m] if extras is None else (x_MbLD[m], extras) for m in range(microbatches)]


def _outputs(items: list, dtype):
  """The inverse of microbatch_items on the finished micro-batches: x whole again; the extras
  averaged over the micro-batches (each counted once, the bubble's never)."""
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *items)
  if not isinstance(stacked, tuple):
    return whole_batch(stacked).astype(dtype)
  return (whole_batch(stacked[0]).astype(dtype),
          jax.tree.map(lambda a: a.mean(0), stacked[1]))


def _rows_of(rows, microbatches: int):
  """A stage's rows for work item k (micro-batch k mod M; k may be traced), or None."""
  if rows is None:
    return lambda k: None
  rows_M = jax.tree.map(lambda a: split_microbatches(a, microbatches), rows)
  return lambda k: jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, k % microbatches, 0, keepdims=False), rows_M)


def manual_pipeline(run: Callable, layers: nnx.Module, carry, axis: str, stages: int,
                    microbatches: int, rows=None):
  """Inside shard_map: this device's stage of `layers` (its share of the stack) on the GPipe
  schedule; returns the last stage's output for the whole local batch, on every stage. `carry`:
  x [B, L, D], or (x, extras) (microbatch_items); `rows`: per-row inputs (module docstring)."""
  stage = jax.lax.axis_index(axis)
  schedule = _Schedule(stages, microbatches, num_groups(layers))
  items = microbatch_items(carry, microbatches)
  dtype = items[0][0].dtype if isinstance(items[0], tuple) else items[0].dtype
  # The circular schedule sends the last stage's output round to stage 0 as well.
  circular = schedule.repeats > 1
  to_next = [(i, (i + 1) % stages) for i in range(stages if circular else stages - 1)]
  state = jax.tree.map(jnp.zeros_like, items[0])
  rows_at = _rows_of(rows, microbatches)
  returning, outputs = {}, []
  for t in range(schedule.iterations):
    first = items[t] if t < microbatches else returning.pop(t, None)
    if first is not None:
      state = jax.tree.map(lambda f, s: jnp.where(stage == 0, f, s), first, state)
    group = layer_group(layers, schedule.group(t, stage)) if circular else layers
    state = run(group, state, rows_at(t - stage))
    if schedule.is_output(t):
      outputs.append(state)
    if t < schedule.iterations - 1:
      state = jax.tree.map(lambda a: jax.lax.ppermute(a, axis, to_next), state)
    if (back := schedule.returns_at(t)) is not None:
      returning[back] = state  # On stage 0 now: the last stage's output.
  # Only the last stage holds the result: broadcast it (the transpose sends the gradient back).
  outputs = jax.tree.map(lambda a: jax.lax.psum(jnp.where(stage == stages - 1, a, 0), axis),
                         outputs)
  return _outputs(outputs, dtype)


def auto_pipeline(run: Callable, layers: nnx.Module, carry, stages: int, microbatches: int,
                  constrain_stages: Callable, constrain: Callable, rows=None):
  """Under jit: the same schedule with a leading stage dimension. `constrain_stages(a,
  logical_axes, activation)` lays `a`'s first dimension out over the `stage` axis and the others
  by the rules for `logical_axes` (theirs, after the first); `constrain(a, logical_axes)` an
  activation without it; `rows` as manual_pipeline's. Every dimension is pinned: left to the
  compiler, the state's micro-batch rows, the finished micro-batches and each stage's parameters
  were whole on every device of the other axes (the 8B plan's head then ran on the whole batch:
  docs/benchmarks.md)."""
  schedule = _Schedule(stages, microbatches, num_groups(layers))
  groups = [layer_group(layers, r) for r in range(schedule.repeats)]
  graphdef, _ = nnx.split(groups[0])

  staged = [split_by_stage(nnx.split(group)[1], stages, constrain_stages) for group in groups]

  def one_stage(stage_params, state, stage_rows):
    return run(nnx.merge(graphdef, stage_params), state, stage_rows)

  each_stage = jax.vmap(one_stage, spmd_axis_name='stage')
  rows_at = _rows_of(rows, microbatches)
  # Each stage's rows at iteration t, [stages, ...]: stage s works on item t - s.
  stage_rows = lambda t: None if rows is None else jax.tree.map(
      lambda *a: constrain_stages(jnp.stack(a), (None,) * a[0].ndim),
      *[rows_at(t - s) for s in range(stages)])
  # x [b, L, D] by the rules; the extras (a few statistics) whole.
  pin = lambda item: _map_x(item, lambda x: constrain(x, _X_AXES))
  pin_S = lambda item_S: _map_x(item_S, lambda x: constrain_stages(x, _X_AXES),
                                lambda a: constrain_stages(a, (None,) * (a.ndim - 1)))
  items = [pin(item) for item in microbatch_items(carry, microbatches)]
  dtype = items[0][0].dtype if isinstance(items[0], tuple) else items[0].dtype
  state_S = pin_S(jax.tree.map(lambda a: jnp.zeros((stages, *a.shape), a.dtype), items[0]))
  returning, outputs = {}, []
  for t in range(schedule.iterations):
    # The shift: stage s takes what stage s - 1 produced; stage 0 the next micro-batch (or one
    # back for its next group).
    first = items[t] if t < microbatches else returning.pop(
        t, jax.tree.map(jnp.zeros_like, items[0]))
    state_S = pin_S(jax.tree.map(lambda f, s: jnp.concatenate([f[None], s[:-1]]), first,
                                 state_S))
    state_S = pin_S(each_stage(_stage_groups(staged, schedule, t), state_S, stage_rows(t)))
    last = pin(jax.tree.map(lambda a: a[-1], state_S))
    if schedule.is_output(t):
      outputs.append(last)
    if (back := schedule.returns_at(t)) is not None:
      returning[back] = last
  return _map_x(_outputs(outputs, dtype), lambda x: constrain(x, _X_AXES))


def split_by_stage(layers_state, stages: int, constrain_stages: Callable,
                   grouped: bool = False):
  """A stack's parameters (an nnx state) [layers, ...] -> [stages, layers per stage, ...]:
  stage s holds layers s*n .. s*n + n - 1, each laid out as stored (FSDP splits stay split until
  a layer gathers them); `constrain_stages` as auto_pipeline's. `grouped`: a grouped stack's
  [groups, layers per group, ...] -> [stages, groups, layers per stage and group, ...]."""
  def by_stage(variable):
    value = variable.get_value()
    axes = logical_axes_of(variable)
    if grouped:
      value = value.reshape(value.shape[0], stages, value.shape[1] // stages, *value.shape[2:])
      value, axes = value.swapaxes(0, 1), (None, None, *axes[2:])
    else:
      value = value.reshape(stages, value.shape[0] // stages, *value.shape[1:])
      axes = (None, *axes[1:])
    return variable.replace(constrain_stages(value, axes, activation=False))

  return jax.tree.map(by_stage, layers_state, is_leaf=_is_variable)


def stack_by_depth(staged: jax.Array, grouped: bool = False) -> jax.Array:
  """The inverse of split_by_stage on one array: [stages, layers per stage, ...] -> [layers,
  ...]; `grouped`: [stages, groups, n, ...] -> [groups, stages n, ...]."""
  if grouped:
    return staged.swapaxes(0, 1).reshape(staged.shape[1], -1, *staged.shape[3:])
  return staged.reshape(-1, *staged.shape[2:])


# The logical axes of the activations that flow through the stack.
_X_AXES = ('batch', 'length', 'embed')


def _is_variable(node) -> bool:
  return isinstance(node, nnx.Variable)


def _map_x(item, on_x: Callable, on_extras: Callable = lambda a: a):
  """An item (x, or (x, extras): microbatch_items) with on_x applied to x, on_extras to every
  leaf of the extras."""
  if not isinstance(item, tuple):
    return on_x(item)
  return on_x(item[0]), jax.tree.map(on_extras, item[1])


def _stage_groups(staged: list, schedule: _Schedule, t: int):
  """The [stages, ...] parameters each stage applies at iteration t: group r of stage s where
  schedule.group(t, s) = r (a select per group, elementwise, so each stage's slice stays put)."""
  chosen = [schedule.group(t, s) for s in range(schedule.stages)]
  params = staged[chosen[0]]
  for r in sorted(set(chosen) - {chosen[0]}):
    mask_S = jnp.array([c == r for c in chosen])
    params = jax.tree.map(
        lambda new, old: jnp.where(mask_S.reshape(-1, *[1] * (old.ndim - 1)), new, old),
        staged[r], params)
  return params
