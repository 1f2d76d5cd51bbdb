"""The next-token loss with the head applied to a slice of the positions at a time
(model.loss_chunks): the float32 logits [B, L, V] of the whole batch never exist, only those
of one chunk, forward and backward.

Each chunk's head and cross-entropy run inside a rematerialised scan body: the forward pass
keeps only the running sum, and the backward pass projects each chunk again (one more head
matmul per step: 2 B L D V FLOPs). Chunk c takes positions c, c + C, c + 2C, ... (C chunks):
a strided slice keeps every chunk split over the batch and length axes the way the features
are, so a layout's sharded length (context parallelism) needs no exchange to be chunked.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_cross_entropy(head_logits: Callable, features_BLD: jax.Array, targets_BL: jax.Array,
                          keep_BL: jax.Array | None, count, ops, chunks: int) -> jax.Array:
  """ops.cross_entropy(head_logits(features_BLD), targets_BL, keep_BL, count), computed over
  `chunks` strided slices of the positions (which must divide L): the kept losses' sum over
  `count`, or without `keep_BL` their mean."""
  B, L = targets_BL.shape
  if keep_BL is None:  # A mean over this device's predictions: their sum over their number.
    keep_BL, count = jnp.ones(targets_BL.shape, bool), B * L

  @jax.checkpoint
  def chunk_sum(x_BlD, targets_Bl, keep_Bl):  # The kept losses' sum (count 1).
    return ops.chunk_loss_sum(head_logits, x_BlD, targets_Bl, keep_Bl)

  # The sums come out per chunk, not in a carry: under shard_map a carry would have to start
  # as varying over the same mesh axes as the sums.
  _, sums_C = jax.lax.scan(lambda _, chunk: (None, chunk_sum(*chunk)), None,
                           (chunk_major(features_BLD, chunks), chunk_major(targets_BL, chunks),
                            chunk_major(keep_BL, chunks)))
  return sums_C.sum() / count


def chunk_major(x_BL_: jax.Array, chunks: int) -> jax.Array:
  """[B, L, ...] -> [C, B, L / C, ...]: chunk c holds positions c, c + C, c + 2C, ..."""
  B, L = x_BL_.shape[:2]
  return jnp.moveaxis(x_BL_.reshape(B, L // chunks, chunks, *x_BL_.shape[2:]), 2, 0)
