"""The pytree operations the self-differentiating pipeline schedules apply to a stack's carry
(engine/parallel/pipeline/one_f_one_b.py, engine/parallel/pipeline/zero_bubble.py): a carry is the
activations x, or (x, extras) with a model's extra terms, which may hold integer counters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def floats(tree) -> list:
  """The leaves that carry gradients (a carry's integer counters do not)."""
  return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.inexact)]


def with_floats(tree, floats: list):
  """`tree` with its inexact leaves replaced, in order."""
  leaves, treedef = jax.tree.flatten(tree)
  it = iter(floats)
  return jax.tree.unflatten(treedef, [next(it) if jnp.issubdtype(a.dtype, jnp.inexact) else a
                                      for a in leaves])


def tree_add(a, b):
  return jax.tree.map(jnp.add, a, b)


def zero_integers(tree):
  """Cotangents for a carry's integer leaves: float0 zeros, as jax.vjp expects."""
  return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact) else
                      np.zeros(a.shape, jax.dtypes.float0), tree)
