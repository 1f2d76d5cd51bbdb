"""`jax.lax.ragged_dot`'s grouped matmul, computed tile by tile over the rows in groups only.

XLA:CPU lowers `ragged_dot` to a dense product of every row with every group's weights, masked
afterwards: E times the useful FLOPs for E groups, and the rows past the groups' sum (the unused
rows of the expert exchange's padded blocks) cost as much as used ones. On CPU the mixture of
experts' dropless dispatch uses this instead: each group's rows are cut into tiles of TILE rows
(a group's last tile masked), and a loop whose trip count is the number of tiles in use
multiplies each tile by its group's weights. The backward pass is two such loops of its own
(custom_vjp: a loop with a traced trip count has no automatic transpose): the input gradient by
the transposed weights, and each group's weight gradient summed over its tiles in float32.
TPUs and GPUs keep `ragged_dot`, which they compile to grouped-matmul kernels.

Shape suffixes: M rows, G groups, D in, F out, N tiles, T rows per tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.models import varying_axes

TILE = 128  # Rows per tile: fewer loop iterations, at most TILE - 1 masked rows per group.


def for_platform(platform: str):
  """The grouped matmul to use on `platform` ('cpu', 'tpu', 'gpu'): ragged_dot's signature."""
  return tiled_ragged_dot if platform == 'cpu' else jax.lax.ragged_dot


def _tiles(group_sizes_G: jax.Array, rows: int):
  """Per tile n of a static upper bound N: (its group, its first row, its rows in use), and how
  many tiles are in use; the tiles of each group are consecutive, in group order."""
  G = group_sizes_G.shape[0]
  ends_G = jnp.cumsum(group_sizes_G)
  tiles_G = (group_sizes_G + TILE - 1) // TILE
  tile_ends_G = jnp.cumsum(tiles_G)
  n_N = jnp.arange(rows // TILE + G, dtype=jnp.int32)
  group_N = jnp.minimum(jnp.searchsorted(tile_ends_G, n_N, side='right'), G - 1)
  first_N = ends_G[group_N] - group_sizes_G[group_N] + (
      n_N - (tile_ends_G[group_N] - tiles_G[group_N])) * TILE
  in_use_N = jnp.clip(ends_G[group_N] - first_N, 0, TILE)
  return group_N, first_N, in_use_N, tile_ends_G[-1]


def _zeros(shape, dtype, like: jax.Array) -> jax.Array:
  """Zeros typed as varying over the mesh axes `like` varies over (inside shard_map), as the
  loops' carries must be from the start."""
  return varying_axes.vary(jnp.zeros(shape, dtype), varying_axes.varying(like))


def _padded(x_MD: jax.Array) -> jax.Array:
  """x with TILE zero rows after it, so that a tile starting at any row stays in bounds."""
  return jnp.concatenate([x_MD, jnp.zeros((TILE, x_MD.shape[1]), x_MD.dtype)])


def _products(x_MD, w_GDF, tiles, transpose_w=False):
  """[M, F]: each row in a group times its group's weights (transposed: w_GDF is [G, F, D]);
  rows in no group are zero."""
  group_N, first_N, in_use_N, used = tiles
  rows, out = x_MD.shape[0], w_GDF.shape[1 if transpose_w else 2]
  x_MD = _padded(x_MD)

  def tile(n, y_MF):
    x_TD = jax.lax.dynamic_slice_in_dim(x_MD, first_N[n], TILE)
    w_DF = w_GDF[group_N[n]]
    y_TF = jnp.dot(x_TD, w_DF.T if transpose_w else w_DF,
                   preferred_element_type=jnp.float32).astype(y_MF.dtype)
    old_TF = jax.lax.dynamic_slice_in_dim(y_MF, first_N[n], TILE)
    kept_TF = jnp.where((jnp.arange(TILE) < in_use_N[n])[:, None], y_TF, old_TF)
    return jax.lax.dynamic_update_slice_in_dim(y_MF, kept_TF, first_N[n], 0)

  y_MF = _zeros((rows + TILE, out), jnp.promote_types(x_MD.dtype, w_GDF.dtype), x_MD)
  return jax.lax.fori_loop(0, used, tile, y_MF)[:rows]


def _weight_gradient(x_MD, dy_MF, groups: int, tiles):
  """[G, D, F]: each group's x^T dy over its rows, summed in float32."""
  group_N, first_N, in_use_N, used = tiles
  x_MD, dy_MF = _padded(x_MD), _padded(dy_MF)

  def tile(n, dw_GDF):
    in_use_T1 = (jnp.arange(TILE) < in_use_N[n])[:, None]
    x_TD = jnp.where(in_use_T1, jax.lax.dynamic_slice_in_dim(x_MD, first_N[n], TILE), 0)
    dy_TF = jax.lax.dynamic_slice_in_dim(dy_MF, first_N[n], TILE)
    return dw_GDF.at[group_N[n]].add(jnp.dot(x_TD.T, dy_TF, preferred_element_type=jnp.float32))

  dw_GDF = _zeros((groups, x_MD.shape[1], dy_MF.shape[1]), jnp.float32, x_MD)
  return jax.lax.fori_loop(0, used, tile, dw_GDF)


def tiled_ragged_dot(x_MD: jax.Array, w_GDF: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """jax.lax.ragged_dot(x_MD, w_GDF, group_sizes_G): rows sorted by group, group_sizes_G rows
  each; rows past their sum give zeros. Inside shard_map the operands are first typed alike
  (varying over every axis one of them varies over), as a jnp product would cast them: the
  casts' transposes then sum the gradients over the axes an operand did not vary over."""
  operands = map(jnp.asarray, (x_MD, w_GDF, group_sizes_G))
  return _tiled(*varying_axes.vary_alike(*operands))


@jax.custom_vjp
def _tiled(x_MD, w_GDF, group_sizes_G):
  return _products(x_MD, w_GDF, _tiles(group_sizes_G, x_MD.shape[0]))


def _forward(x_MD, w_GDF, group_sizes_G):
  tiles = _tiles(group_sizes_G, x_MD.shape[0])  # Kept for the backward pass.
  return _products(x_MD, w_GDF, tiles), (x_MD, w_GDF, tiles)


def _backward(saved, dy_MF):
  x_MD, w_GDF, tiles = saved
  dx_MD = _products(dy_MF.astype(x_MD.dtype), w_GDF, tiles, transpose_w=True)
  dw_GDF = _weight_gradient(x_MD, dy_MF.astype(x_MD.dtype), w_GDF.shape[0], tiles)
  return dx_MD.astype(x_MD.dtype), dw_GDF.astype(w_GDF.dtype), None


_tiled.defvjp(_forward, _backward)
