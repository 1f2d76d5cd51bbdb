"""Pipeline parallelism: the stacked layers split into `stage` groups of consecutive layers, the
batch into micro-batches that flow from stage to stage on a GPipe schedule.

Iteration t (of microbatches + stages - 1): stage 0 takes micro-batch t, every other stage what
its predecessor produced at t - 1; each stage applies its own layers; the last stage's output is
micro-batch t - (stages - 1)'s. The backward pass runs the schedule in reverse (JAX's transpose
of the forward loop). A stage idles for stages - 1 of the iterations: the bubble, a fraction
(stages - 1) / (microbatches + stages - 1) of the step.

Only the stacked layers are pipelined. The embedding before them and the head and loss after
them run on every stage (their parameters are replicated over `stage`), on the last stage's
output, which is broadcast to all stages (manual: a masked psum; auto: the compiler's choice).

Manual mode shifts activations to the next stage with `ppermute` inside shard_map; auto mode
expresses the same schedule on a [stages, ...] array sharded over `stage`, shifted by one along
it each iteration, which the compiler turns into a collective-permute.

Shape suffixes: M micro-batches, S stages, B batch (b = B / M), L length, D embed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from engine.parallel.steps import split_microbatches


def bubble_fraction(stages: int, microbatches: int) -> float:
  """The fraction of a GPipe step each stage spends idle."""
  return (stages - 1) / (microbatches + stages - 1)


def _whole_batch(x_MbLD: jax.Array) -> jax.Array:
  """The inverse of split_microbatches."""
  return x_MbLD.swapaxes(0, 1).reshape(-1, *x_MbLD.shape[2:])


def manual_pipeline(run: Callable, layers: nnx.Module, x_BLD: jax.Array, axis: str, stages: int,
                    microbatches: int) -> jax.Array:
  """Inside shard_map: this device's stage of `layers` (its share of the stack) on the GPipe
  schedule; returns the last stage's output for the whole local batch, on every stage."""
  stage = jax.lax.axis_index(axis)
  x_MbLD = split_microbatches(x_BLD, microbatches)
  to_next = [(i, i + 1) for i in range(stages - 1)]
  state_bLD = jnp.zeros_like(x_MbLD[0])
  outputs = []
  for t in range(microbatches + stages - 1):
    if t < microbatches:
      state_bLD = jnp.where(stage == 0, x_MbLD[t], state_bLD)
    state_bLD = run(layers, state_bLD)
    if t >= stages - 1:
      outputs.append(state_bLD)
    if t < microbatches + stages - 2:
      state_bLD = jax.lax.ppermute(state_bLD, axis, to_next)
  y_MbLD = jnp.stack(outputs)
  # Only the last stage holds the result: broadcast it (the transpose sends the gradient back).
  y_MbLD = jax.lax.psum(jnp.where(stage == stages - 1, y_MbLD, 0), axis)
  return _whole_batch(y_MbLD).astype(x_BLD.dtype)


def auto_pipeline(run: Callable, layers: nnx.Module, x_BLD: jax.Array, stages: int,
                  microbatches: int, constrain_stages: Callable) -> jax.Array:
  """Under jit: the same schedule with a leading stage dimension. `constrain_stages(a)` lays
  `a`'s first dimension out over the `stage` axis."""
  graphdef, params = nnx.split(layers)
  # [layers, ...] -> [stages, layers per stage, ...]: stage s holds layers s*n .. s*n + n - 1.
  staged = jax.tree.map(
      lambda p: constrain_stages(p.reshape(stages, p.shape[0] // stages, *p.shape[1:])), params)

  def one_stage(stage_params, x_bLD):
    return run(nnx.merge(graphdef, stage_params), x_bLD)

  each_stage = jax.vmap(one_stage, spmd_axis_name='stage')
  x_MbLD = split_microbatches(x_BLD, microbatches)
  state_SbLD = constrain_stages(jnp.zeros((stages, *x_MbLD.shape[1:]), x_BLD.dtype))
  outputs = []
  for t in range(microbatches + stages - 1):
    # The shift: stage s takes what stage s - 1 produced; stage 0 the next micro-batch.
    first = x_MbLD[t] if t < microbatches else jnp.zeros_like(x_MbLD[0])
    state_SbLD = constrain_stages(jnp.concatenate([first[None], state_SbLD[:-1]]))
    state_SbLD = constrain_stages(each_stage(staged, state_SbLD))
    if t >= stages - 1:
      outputs.append(state_SbLD[-1])
  return _whole_batch(jnp.stack(outputs)).astype(x_BLD.dtype)
