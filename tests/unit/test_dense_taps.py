"""A layer stack's backward pass split in two (engine/models/dense_taps.py): the input pass and
the weight pass add up to jax.grad of the whole stack, each taking only its own share."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from engine.models import dense_taps, layers
from engine.models.ops import LocalOps


class _Layer(nnx.Module):
  """Three projections, two of them on one input, around a norm-like scale and a bias:
  parameters of both passes."""

  def __init__(self, rngs):
    normal = lambda *shape: nnx.Param(0.3 * jax.random.normal(rngs.params(), shape))
    self.scale, self.bias = normal(8), normal(16)
    self.w_in, self.w_gate, self.w_out = normal(8, 16), normal(8, 16), normal(16, 8)

  def __call__(self, x, ops):
    scaled = x * self.scale[...]
    h = layers.dense(scaled, self.w_in[...]) + self.bias[...]
    h = h * jax.nn.sigmoid(layers.dense(scaled, self.w_gate[...]))
    return x + layers.dense(jnp.tanh(h), self.w_out[...])


class _KeepRun(LocalOps):
  """Keeps the `run` the stack hands over, as a pipeline's model cut does (without running
  it)."""

  def stack(self, run, stacked, x):
    self.run = run
    return x


def _split_gradients(stack, x, dy):
  graphdef, state = nnx.split(stack)
  ops = _KeepRun()
  layers.apply_layers(stack, x, ops)
  run = lambda s, x, taps: ops.run(nnx.merge(graphdef, s), x, None, taps)
  recorded = jax.eval_shape(lambda s: run(s, x, dense_taps.Taps(dense_taps.RECORD))[1], state)
  through = lambda s, x, taps: run(s, x, dense_taps.Taps(dense_taps.INPUT, taps))
  _, input_vjp, inputs = jax.vjp(through, state, x, dense_taps.zero_taps(recorded),
                                 has_aux=True)
  d_input_pass, dx, d_taps = input_vjp(dy)
  # Per layer: the three projections' outputs, their two distinct inputs.
  assert [a.shape for a in d_taps] == [(3, 2, 5, 16)] * 2 + [(3, 2, 5, 8)]
  assert [a.shape for a in inputs] == [(3, 2, 5, 8), (3, 2, 5, 16)]
  outputs = lambda s: run(s, jnp.zeros_like(x), dense_taps.Taps(dense_taps.WEIGHT, inputs))[1]
  _, weight_vjp = jax.vjp(outputs, state)
  return d_input_pass, weight_vjp(d_taps)[0], dx


def test_the_input_and_weight_passes_add_up_to_the_whole_backward_pass():
  stack = layers.stack_layers(_Layer, 3, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
  graphdef, state = nnx.split(stack)
  whole = lambda s, x: layers.apply_layers(nnx.merge(graphdef, s), x, LocalOps())
  _, whole_vjp = jax.vjp(whole, state, x)
  want, want_dx = whole_vjp(dy)
  d_input_pass, d_weight_pass, dx = _split_gradients(stack, x, dy)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
  got, want = nnx.to_pure_dict(d_input_pass), nnx.to_pure_dict(want)
  weights = nnx.to_pure_dict(d_weight_pass)
  for name in ('scale', 'bias'):  # Outside the projections: the input pass's alone.
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert not np.any(weights[name])
  for name in ('w_in', 'w_gate', 'w_out'):  # The projections' weights: the weight pass's alone.
    np.testing.assert_allclose(weights[name], want[name], rtol=1e-5, atol=1e-6)
    assert not np.any(got[name]) and np.any(want[name])


def test_outside_a_tapped_stack_dense_is_the_plain_product():
  x, w = jnp.ones((2, 3, 4)), jnp.full((4, 5), 0.5)
  np.testing.assert_array_equal(layers.dense(x, w), jnp.full((2, 3, 5), 2.0))
