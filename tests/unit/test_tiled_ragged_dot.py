"""The tiled grouped matmul of CPU's dropless dispatch (engine/models/moe/tiled_ragged_dot.py)
against jax.lax.ragged_dot: values and both gradients, with empty groups, groups that end inside a
tile, rows past the groups (which must give zeros and no gradient), inside a checked shard_map and
under vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.models.moe import tiled_ragged_dot as tiled
from engine.models.moe.tiled_ragged_dot import TILE, tiled_ragged_dot

D, F = 16, 24
SIZES = [TILE + 3, 0, 5, 2 * TILE, 1]  # Ends inside a tile, empty, short, whole tiles, one row.


def _operands(rows, groups, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (rows, D)), jax.random.normal(kw, (groups, D, F))


def _loss(matmul, sizes):
  return lambda x, w: (jnp.sin(matmul(x, w, sizes)) ** 2).sum()


@pytest.mark.parametrize('spare_rows', [0, 40], ids=['rows_all_in_groups', 'rows_past_groups'])
def test_values_and_gradients_are_ragged_dots(spare_rows):
  sizes = jnp.array(SIZES, jnp.int32)
  x, w = _operands(sum(SIZES) + spare_rows, len(SIZES))
  np.testing.assert_allclose(tiled_ragged_dot(x, w, sizes), jax.lax.ragged_dot(x, w, sizes),
                             atol=1e-5, rtol=1e-5)
  got = jax.jit(jax.grad(_loss(tiled_ragged_dot, sizes), (0, 1)))(x, w)
  want = jax.grad(_loss(jax.lax.ragged_dot, sizes), (0, 1))(x, w)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)
  if spare_rows:  # No group's row: zero out, zero gradient.
    assert not np.asarray(tiled_ragged_dot(x, w, sizes)[-spare_rows:]).any()
    assert not np.asarray(got[0][-spare_rows:]).any()


def test_a_group_boundary_inside_a_tile_is_kept():
  """The planted bug: a group's last tile not masked at the group's end, so that its weight
  gradient takes in the next group's first rows, is far off the reference."""
  sizes = jnp.array(SIZES, jnp.int32)
  x, w = _operands(sum(SIZES), len(SIZES))
  dy = jax.random.normal(jax.random.key(5), (x.shape[0], F))
  want = jax.grad(lambda w: (jax.lax.ragged_dot(x, w, sizes) * dy).sum())(w)
  tiles = tiled._tiles(sizes, x.shape[0])
  np.testing.assert_allclose(tiled._weight_gradient(x, dy, len(SIZES), tiles), want,
                             atol=1e-4, rtol=1e-4)
  group_N, first_N, in_use_N, used = tiles
  unmasked = (group_N, first_N, jnp.full_like(in_use_N, TILE), used)
  assert np.abs(tiled._weight_gradient(x, dy, len(SIZES), unmasked) - want).max() > 1.0


def test_inside_shard_map_and_under_vmap():
  mesh = jax.make_mesh((4, 2), ('a', 'b'))
  x, w = _operands(4 * 300, 4 * 3, seed=1)
  sizes = jnp.array([100, 0, 150], jnp.int32)

  def difference(x, w):  # x varies over `a`, w too; the products over `b` are invariant.
    got = jax.grad(_loss(tiled_ragged_dot, sizes), (0, 1))(x, w)
    want = jax.grad(_loss(jax.lax.ragged_dot, sizes), (0, 1))(x, w)
    return got[0] - want[0], got[1] - want[1]

  placed = [jax.device_put(a, NamedSharding(mesh, P('a'))) for a in (x, w)]
  for d in jax.jit(jax.shard_map(difference, mesh=mesh, in_specs=(P('a'), P('a')),
                                 out_specs=(P('a'), P('a'))))(*placed):
    assert np.abs(np.asarray(d)).max() < 1e-3
  rows = jnp.stack([x[:300], x[300:600]])
  sizes_2G = jnp.array([[100, 0, 150], [0, 299, 1]], jnp.int32)
  grad = lambda f: lambda x, s: jax.grad(lambda x: _loss(f, s)(x, w[:3]))(x)
  batched = jax.vmap(grad(tiled_ragged_dot))(rows, sizes_2G)
  for i in range(2):
    np.testing.assert_allclose(batched[i], grad(jax.lax.ragged_dot)(rows[i], sizes_2G[i]),
                               atol=1e-4, rtol=1e-4)


def test_only_cpu_takes_the_tiles():
  assert tiled.for_platform('cpu') is tiled_ragged_dot
  assert tiled.for_platform('tpu') is jax.lax.ragged_dot
  assert tiled.for_platform('gpu') is jax.lax.ragged_dot
