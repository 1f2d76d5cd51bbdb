"""A model cut at its layer stack, for pipeline schedules that take gradients themselves.

A model calls `ops.stack(run, layers, carry)` once, between what comes before its stacked layers
(the embedding) and what comes after them (the final norm, the head and, in the train step, the
loss). A schedule that interleaves micro-batches' forward and backward passes (1F1B) needs those
three parts as functions of their own, to differentiate each with `jax.vjp`:

  embed(params, tokens)             -> the stack's input carry for the whole batch
  stage(layers_params, carry, rows) -> the carry through the layers given (one stage's share;
                                       of a grouped stack, of one group; with taps, the
                                       backward pass split in two: dense_taps)
  head(params, carry, tokens)       -> (the loss of those tokens, the model's statistics)

Each is the train step's own loss function (engine.parallel.steps.next_token_loss) run with ops
whose `stack` stops the model there (embed), returns a given carry instead (head), or is the
`run` the model handed over (stage): nothing here is written for one model family.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import jax
from flax import nnx

from engine.models.layers import layer_group, num_groups


class _StackReached(Exception):
  """Raised by the stack of `embed`'s ops: the model has computed the stack's input."""

  def __init__(self, run: Callable, layers: nnx.Module, carry):
    super().__init__('the model reached its layer stack')
    self.run, self.layers, self.carry = run, layers, carry


def _with_stack(ops, stack: Callable):
  """A copy of `ops` whose `stack(run, layers, carry)` is `stack` (copies made from it by
  `with_documents` keep it)."""
  ops = copy.copy(ops)
  ops.stack = stack
  return ops


def _stop(run, layers, carry):
  raise _StackReached(run, layers, carry)


def _reach_stack(loss: Callable, params, tokens, ops) -> _StackReached:
  try:
    loss(params, tokens, _with_stack(ops, _stop))
  except _StackReached as reached:
    return reached
  raise ValueError('the model never called ops.stack: a pipeline needs its layers stacked '
                   '(engine.models.layers.apply_layers)')


def _path_to(tree: dict, leaves: list) -> tuple[str, ...]:
  """The keys leading to the subtree of `tree` whose leaves are exactly `leaves` (the same
  objects)."""
  wanted = {id(leaf) for leaf in leaves}
  if {id(leaf) for leaf in jax.tree.leaves(tree)} == wanted:
    return ()
  for key, subtree in tree.items() if isinstance(tree, dict) else ():
    if {id(leaf) for leaf in jax.tree.leaves(subtree)} >= wanted:
      return (key, *_path_to(subtree, leaves))
  raise ValueError('the stacked layers are not one subtree of the parameters')


class ModelCut:
  """The three parts of `loss(params, tokens, ops) -> (loss, statistics)` (the module
  docstring), traced once on the step's own parameters and tokens to find the stack."""

  def __init__(self, loss: Callable, params, tokens, ops):
    self.loss = loss
    reached = _reach_stack(loss, params, tokens, ops)
    self.run = reached.run
    self.stack_graphdef, layers_state = nnx.split(reached.layers)
    self.layers_path = _path_to(params, jax.tree.leaves(layers_state))
    # A grouped stack (train.pipeline_repeats > 1) runs one group at a time: `stage` takes the
    # parameters of one.
    self.chunks = num_groups(reached.layers)
    self.layers_graphdef = nnx.split(layer_group(reached.layers, 0))[0]

  def layers_params(self, params):
    """The stacked layers' subtree of `params`."""
    for key in self.layers_path:
      params = params[key]
    return params

  def with_layers_params(self, params, layers_params):
    """`params` with the stacked layers' subtree replaced."""
    if not self.layers_path:
      return layers_params
    *parents, last = self.layers_path
    params = dict(params)
    node = params
    for key in parents:
      node[key] = dict(node[key])
      node = node[key]
    node[last] = layers_params
    return params

  def embed(self, params, tokens, ops):
    return _reach_stack(self.loss, params, tokens, ops).carry

  def stage(self, layers_params, carry, rows, taps=None):
    """The carry through the layers given; with `taps` (engine/models/dense_taps.py), also what
    their mode returns per dense call, stacked per layer."""
    return self.run(nnx.merge(self.layers_graphdef, layers_params), carry, rows, taps)

  def head(self, params, carry, tokens, ops, **loss_options):
    return self.loss(params, tokens, _with_stack(ops, lambda run, layers, x: carry),
                     **loss_options)
