"""Quantized projections (engine/models/quantized_matmul.py) against NumPy's account of the same
quantization (tests/support/quantized_reference.py): forward and both backward products, alone
and as each mode runs them on a mesh (a column-parallel and a row-parallel projection)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.models import layers, quantized_matmul
from tests.support import quantized_reference

BLOCK = 8
# One quantum's error in one element moves the products by about 1e-3 of their scale; float32
# summation order moves them by about 1e-7.
RTOL = 1e-5


def _operands(seed, n=32, k=64, f=32):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (n, k)), 0.1 * jax.random.normal(keys[1], (k, f)),
          jax.random.normal(keys[2], (n, f)))


def _assert_close(actual, expected, what):
  scale = np.abs(expected).max()
  np.testing.assert_allclose(np.asarray(actual) / scale, expected / scale, atol=RTOL, rtol=0,
                             err_msg=what)


def _dense_and_grads(x, w, dy, precision, finish=lambda y: y):
  y, vjp = jax.vjp(lambda x, w: finish(layers.dense(x, w, precision=precision)), x, w)
  return (y, *vjp(dy))


@pytest.mark.parametrize('name', ['int8', 'fp8'])
@pytest.mark.parametrize('shape', [(32, 64, 32), (16, BLOCK, 32), (BLOCK, 64, BLOCK)],
                         ids=['blocks', 'one_forward_block', 'one_backward_block'])
def test_forward_and_backward_match_numpy(name, shape):
  x, w, dy = _operands(0, *shape)
  got = _dense_and_grads(x, w, dy, quantized_matmul.MatmulPrecision(name, BLOCK))
  expected = quantized_reference.quantized_dense(*map(np.asarray, (x, w, dy)), name, BLOCK)
  for what, a, e in zip(('y', 'dx', 'dw'), got, expected):
    _assert_close(a, e, f'{name} {what}')


@pytest.mark.parametrize('name', ['int8', 'fp8'])
def test_a_different_quantization_fails_the_comparison(name):
  """The comparison can tell: the plain product, and the same format in blocks of another size,
  are both far outside its tolerance."""
  x, w, dy = _operands(0)
  got = _dense_and_grads(x, w, dy, quantized_matmul.MatmulPrecision(name, BLOCK))
  plain = _dense_and_grads(x, w, dy, quantized_matmul.DEFAULT)
  other_blocks = quantized_reference.quantized_dense(*map(np.asarray, (x, w, dy)), name,
                                                     2 * BLOCK)
  for a, p, c in zip(got, plain, other_blocks):
    with pytest.raises(AssertionError):
      _assert_close(a, np.asarray(p), 'plain')
    with pytest.raises(AssertionError):
      _assert_close(a, c, 'other blocks')


def test_default_precision_is_the_plain_product():
  x, w, dy = _operands(0)
  got = _dense_and_grads(x, w, dy, quantized_matmul.DEFAULT)
  xn, wn, dyn = map(np.asarray, (x, w, dy))
  for what, a, e in zip(('y', 'dx', 'dw'), got, (xn @ wn, dyn @ wn.T, xn.T @ dyn)):
    np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=1e-5, err_msg=what)


def _mesh():
  return jax.make_mesh((2, 4), ('data', 'tensor'), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize('name', ['int8', 'fp8'])
def test_manual_row_and_column_parallel_projections_match_numpy(name):
  """Under shard_map: tokens split over `data`; a column-parallel projection splits w's
  outputs over `tensor`, a row-parallel one its contraction, finished with a psum. Every device
  quantizes its own blocks: the products and both gradients are the one-device quantization's.
  (An operand that does not vary over an axis gets its partial gradients summed over it, as
  with the plain product: x's over `tensor` in the column-parallel case, w's over `data`.)"""
  precision = quantized_matmul.MatmulPrecision(name, BLOCK)
  x, w, dy = _operands(2)
  mesh = _mesh()

  def column(x, w, dy):
    return _dense_and_grads(x, w, dy, precision)

  def row(x, w, dy):
    return _dense_and_grads(x, w, dy, precision, lambda y: jax.lax.psum(y, 'tensor'))

  expected = quantized_reference.quantized_dense(*map(np.asarray, (x, w, dy)), name, BLOCK)
  layouts = {
      'column': (column, (P('data'), P(None, 'tensor'), P('data', 'tensor')),
                 (P('data', 'tensor'), P('data'), P(None, 'tensor'))),
      'row': (row, (P('data', 'tensor'), P('tensor'), P('data')),
              (P('data'), P('data', 'tensor'), P('tensor'))),
  }
  for layout, (body, in_specs, out_specs) in layouts.items():
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip((x, w, dy), in_specs)]
    for what, a, e in zip(('y', 'dx', 'dw'), step(*args), expected):
      _assert_close(a, e, f'{name} {layout} {what}')


@pytest.mark.parametrize('name', ['int8', 'fp8'])
def test_auto_sharded_projection_matches_numpy(name):
  """Under jit with sharded operands the compiler partitions the same blocks."""
  precision = quantized_matmul.MatmulPrecision(name, BLOCK)
  x, w, dy = _operands(3)
  mesh = _mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  step = jax.jit(functools.partial(_dense_and_grads, precision=precision))
  got = step(put(x, P('data', 'tensor')), put(w, P('tensor')), put(dy, P('data')))
  expected = quantized_reference.quantized_dense(*map(np.asarray, (x, w, dy)), name, BLOCK)
  for what, a, e in zip(('y', 'dx', 'dw'), got, expected):
    _assert_close(a, e, f'{name} {what}')


@pytest.mark.parametrize('name', ['int8', 'fp8'])
def test_batched_experts_match_numpy_expert_by_expert(name):
  """A capacity dispatch's [E, N, K] @ [E, K, F]: each expert's block is the 2-D projection."""
  precision = quantized_matmul.MatmulPrecision(name, BLOCK)
  operands = [_operands(seed) for seed in range(3)]
  x, w, dy = (jnp.stack(parts) for parts in zip(*operands))
  y, vjp = jax.vjp(lambda x, w: quantized_matmul.batched_matmul(x, w, precision), x, w)
  got = (y, *vjp(dy))
  for e, (xe, we, dye) in enumerate(operands):
    expected = quantized_reference.quantized_dense(*map(np.asarray, (xe, we, dye)), name, BLOCK)
    for what, a, ex in zip(('y', 'dx', 'dw'), got, expected):
      _assert_close(a[e], ex, f'{name} expert {e} {what}')
