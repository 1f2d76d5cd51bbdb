"""Muon (optim.name=muon): optax's Muon on the layers' matrices, the engine's AdamW on the rest.

Which parameters are matrices, and which of their dimensions Newton-Schulz orthogonalizes, follows
from their logical axes (`dimension_numbers`): the stacked layers, a mixture's experts and a fused
projection's q / k / v index are batch dimensions (separate matrices); the other dimensions must
all be projection dimensions (embed, heads, kv_heads, head_dim, mlp, latent). A projection out of
the residual stream contracts `embed` (its first dimension), one back into it produces `embed`
(its last), and any other (latent attention's up-projections) contracts its first. Embeddings,
the head (vocab), norms, biases, positions and the router (an unnamed expert dimension) stay on
AdamW, as Muon's authors and optax's `muon` keep them.

Each matrix's update is optax's: momentum with Nesterov (optax.contrib.scale_by_muon, with
optim.muon_beta and optim.muon_ns_steps), Newton-Schulz, Keller Jordan's width scale
sqrt(max(1, fan_out / fan_in)), then decoupled weight decay and the learning rate
optim.muon_learning_rate on the run's schedule. The AdamW part is the one optim.name=adamw runs.

Newton-Schulz needs each matrix whole. Auto mode hands optax the global arrays, and XLA
partitions the iteration's matmuls; manual mode makes each split matrix's update and momentum
whole first (engine/parallel/muon_blocks.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from engine import sharding
from engine.models.layers import FIRST_LAYERS, LAYERS

# Dimensions that index separate matrices: stacked layers, experts, a fused projection's q / k / v.
BATCH_AXES = (LAYERS, FIRST_LAYERS, 'experts', 'qkv')
# Dimensions of a projection: anything else (vocab, norm, an unnamed dimension) leaves a
# parameter to AdamW.
MATRIX_AXES = ('embed', 'heads', 'kv_heads', 'head_dim', 'mlp', 'latent')


def dimension_numbers(logical_axes: tuple[str | None, ...]) -> MuonDimensionNumbers | None:
  """How Muon reads a parameter with these logical axes: its reduction (input) and output
  dimensions, the rest batch; None for a parameter AdamW keeps."""
  matrix = [i for i, name in enumerate(logical_axes) if name not in BATCH_AXES]
  if len(matrix) < 2 or any(logical_axes[i] not in MATRIX_AXES for i in matrix):
    return None
  if logical_axes[matrix[-1]] == 'embed' and logical_axes[matrix[0]] != 'embed':
    return MuonDimensionNumbers(tuple(matrix[:-1]), (matrix[-1],))  # Back into the residual.
  return MuonDimensionNumbers((matrix[0],), tuple(matrix[1:]))


def is_dims(node) -> bool:
  return node is None or isinstance(node, MuonDimensionNumbers)


def parameter_dims(state: nnx.State) -> dict:
  """dimension_numbers of every parameter of a model state (nnx Variables, abstract or not),
  as a pure dict like the parameters."""
  return nnx.to_pure_dict(jax.tree.map(
      lambda v: v.replace(dimension_numbers(sharding.logical_axes_of(v))), state,
      is_leaf=sharding.is_variable))


def partitioned(dims) -> tuple[dict, dict]:
  """(optax.partition's labels, 'muon' or 'adam' per parameter; the dimension numbers with
  AdamW's parameters masked, as Muon's part of the partition sees them)."""
  return (jax.tree.map(lambda d: 'adam' if d is None else 'muon', dims, is_leaf=is_dims),
          jax.tree.map(lambda d: optax.MaskedNode() if d is None else d, dims, is_leaf=is_dims))


def scale_by_width(dims) -> optax.GradientTransformation:
  """optax's Muon width scale (Keller Jordan's): each matrix's update times
  sqrt(max(1, fan_out / fan_in)), from its whole shape."""

  def update(updates, state, params=None):
    del params

    def scaled(update, dim_numbers):
      reduction, output = matrix_axes(dim_numbers)
      fan_in = math.prod(update.shape[a] for a in reduction)
      fan_out = math.prod(update.shape[a] for a in output)
      return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * update

    # A masked (AdamW) leaf is an empty node in both trees: nothing to scale.
    return jax.tree.map(scaled, updates, dims), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def muon(optim_config, schedule: optax.Schedule, adamw: optax.GradientTransformation,
         dims, whole: Callable | None = None) -> optax.GradientTransformation:
  """Muon on the parameters whose `dims` (a tree like the parameters: dimension_numbers of
  each) are set, `adamw` on the others. `whole(tx)`, manual mode's, runs the orthogonalizing
  part on whole matrices."""
  labels, matrix_dims = partitioned(dims)
  orthogonalized = optax.chain(
      scale_by_muon(beta=optim_config.muon_beta, ns_steps=optim_config.muon_ns_steps,
                    weight_dimension_numbers=matrix_dims),
      scale_by_width(matrix_dims))
  ratio = optim_config.muon_learning_rate / optim_config.learning_rate
  matrices = optax.chain(
      whole(orthogonalized) if whole else orthogonalized,
      optax.add_decayed_weights(optim_config.weight_decay),
      optax.scale_by_learning_rate(lambda step: schedule(step) * ratio))
  return optax.partition({'muon': matrices, 'adam': adamw}, labels)


def matrix_axes(dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(reduction dimensions, output dimensions) of dimension numbers, each as a tuple."""
  as_tuple = lambda axis: (axis,) if isinstance(axis, int) else tuple(axis)
  return as_tuple(dims.reduction_axis), as_tuple(dims.output_axis)
