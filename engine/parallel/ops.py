"""The few operations through which the model meets the parallel layout.

The model is written once and calls these at the points where a layout may need communication:
constraining an activation's sharding, reading a parameter, finishing a contraction over a
sharded dimension, looking up embeddings, computing the loss. `LocalOps` is the plain
single-device computation; `AutoOps` adds sharding constraints for jax.jit and lets the compiler
insert the collectives. A manual (shard_map) implementation writes the collectives itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from engine.sharding import Rules, logical_axes_of


class LocalOps:
  """No layout: the reference computation that every parallel mode must reproduce."""

  def constrain(self, x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    del logical_axes
    return x

  def param(self, variable: nnx.Variable) -> jax.Array:
    return variable[...]

  def layer(self, fn):
    """Wraps the function that applies one stacked layer (a layout may rematerialise it)."""
    return fn

  def finish_contraction(self, y: jax.Array, contracted: str) -> jax.Array:
    """Called after a matmul that summed over the logical dimension `contracted`."""
    del contracted
    return y

  def embed_lookup(self, table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    return jnp.take(table_VD, tokens_BL, axis=0)

  def cross_entropy(self, logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits_BLV.astype(jnp.float32), targets_BL)
    return losses.mean()


class AutoOps(LocalOps):
  """jax.jit mode: activations get sharding constraints from the rules; XLA does the rest."""

  def __init__(self, mesh: jax.sharding.Mesh, rules: Rules):
    self.mesh = mesh
    self.rules = rules

  def constrain(self, x, logical_axes):
    spec = self.rules.spec(logical_axes, activation=True)
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def param(self, variable):
    # Pin parameters inside the step to their stored layout so that the compiler gathers them
    # where they are used instead of re-laying-out whole tensors.
    spec = self.rules.spec(logical_axes_of(variable))
    return jax.lax.with_sharding_constraint(variable[...], NamedSharding(self.mesh, spec))

  def embed_lookup(self, table_VD, tokens_BL):
    if not self.rules.mesh_axes('vocab'):
      return super().embed_lookup(table_VD, tokens_BL)
    # A gather from a vocab-sharded table makes XLA replicate the table first; a one-hot matmul
    # instead partitions like a row-parallel layer (local partial sums, one all-reduce).
    one_hot_BLV = jax.nn.one_hot(tokens_BL, table_VD.shape[0], dtype=table_VD.dtype)
    one_hot_BLV = self.constrain(one_hot_BLV, ('batch', 'length', 'vocab'))
    return jnp.einsum('BLV,VD->BLD', one_hot_BLV, table_VD)
