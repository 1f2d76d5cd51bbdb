"""Adam's moments in bfloat16 (optim.mu_dtype, optim.nu_dtype): the optimizer against a NumPy AdamW
that rounds the stored moments to bfloat16 (the step's own update uses the unrounded ones), and
optax's own mu_dtype shown off it (it decays the moment with b1 rounded to bfloat16); the
state's dtypes and bytes; both modes against one device on data x fsdp x
tensor; a run stopped and resumed equals an uninterrupted one, and resumes with float32
moments too."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from engine.config import default_config
from engine.assemble import lay_out
from engine.optimizer import make_optimizer
from tests.parity.test_llama import llama_config
from tests.support.helpers import (ATOL, PARAM_ATOL, assert_resumes_exactly, engine_run,
                                   single_device_run, tiny_config)

STEPS = 3


def _optim(mu_dtype):
  optim = default_config().optim
  optim.mu_dtype, optim.warmup_steps, optim.learning_rate = mu_dtype, 0, 0.01
  optim.schedule = 'constant'
  return optim


def _bfloat16(x):
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def numpy_adamw(params, grads, optim, round_mu, round_nu=False):
  """STEPS AdamW steps in float32 NumPy; with `round_mu` (`round_nu`) the stored first (second)
  moment is rounded to bfloat16 (the step's own update uses the unrounded one). Weight decay on
  matrices (weight_decay_on='matrices')."""
  f32 = np.float32
  b1, b2, lr, decay = f32(optim.b1), f32(optim.b2), f32(optim.learning_rate), f32(
      optim.weight_decay)
  p = {k: np.array(v, f32) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in p.items()}
  nu = {k: np.zeros_like(v) for k, v in p.items()}
  keep_mu, keep_nu = (_bfloat16 if r else (lambda x: x) for r in (round_mu, round_nu))
  for t, g in enumerate(grads, 1):
    for k in p:
      new_mu = b1 * mu[k] + (f32(1) - b1) * g[k]
      new_nu = b2 * nu[k] + (f32(1) - b2) * g[k] * g[k]
      update = (new_mu / (f32(1) - b1 ** t)) / (np.sqrt(new_nu / (f32(1) - b2 ** t)) + f32(1e-8))
      if p[k].ndim >= 2:
        update = update + decay * p[k]
      p[k] = p[k] - lr * update
      mu[k], nu[k] = keep_mu(new_mu), keep_nu(new_nu)
  return p, mu


def _engine_adamw(params, grads, optim):
  optimizer = make_optimizer(optim, num_steps=STEPS)
  state = optimizer.tx.init(params)
  for g in grads:
    updates, state = optimizer.tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  is_adam = lambda node: isinstance(node, optax.ScaleByAdamState)
  (adam,) = [s for s in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(s)]
  return params, adam


def test_bfloat16_moments_follow_numpy_adamw():
  rng = np.random.default_rng(0)
  params = {'w': rng.standard_normal((8, 16)).astype(np.float32),
            'b': rng.standard_normal(16).astype(np.float32)}
  grads = [{k: (1e-2 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
           for _ in range(STEPS)]
  optim = _optim('bfloat16')
  got, adam = _engine_adamw(params, grads, optim)
  assert {k: v.dtype for k, v in adam.mu.items()} == {'w': jnp.bfloat16, 'b': jnp.bfloat16}
  assert {k: v.dtype for k, v in adam.nu.items()} == {'w': jnp.float32, 'b': jnp.float32}
  want, want_mu = numpy_adamw(params, grads, optim, round_mu=True)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(adam.mu[k], np.float32), want_mu[k])
  # The rounding matters: a reference keeping float32 moments is far off the engine's; so is
  # optax's own mu_dtype, the planted bug this wrapper avoids.
  unrounded, _ = numpy_adamw(params, grads, optim, round_mu=False)
  assert max(np.abs(got[k] - unrounded[k]).max() for k in params) > 30 * 1e-6
  plain = optax.adamw(optim.learning_rate, optim.b1, optim.b2, weight_decay=optim.weight_decay,
                      mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p),
                      mu_dtype=jnp.bfloat16)
  state, optax_params = plain.init(params), params
  for g in grads:
    updates, state = plain.update(g, state, optax_params)
    optax_params = optax.apply_updates(optax_params, updates)
  assert max(np.abs(optax_params[k] - want[k]).max() for k in params) > 30 * 1e-6


def test_a_bfloat16_second_moment_follows_numpy_adamw_too():
  rng = np.random.default_rng(1)
  params = {'w': rng.standard_normal((8, 16)).astype(np.float32)}
  grads = [{'w': (1e-2 * rng.standard_normal((8, 16))).astype(np.float32)} for _ in range(STEPS)]
  optim = _optim('bfloat16')
  optim.nu_dtype = 'bfloat16'
  got, adam = _engine_adamw(params, grads, optim)
  assert adam.nu['w'].dtype == jnp.bfloat16
  want, _ = numpy_adamw(params, grads, optim, round_mu=True, round_nu=True)
  np.testing.assert_allclose(got['w'], want['w'], atol=1e-6, rtol=0)
  first_only, _ = numpy_adamw(params, grads, optim, round_mu=True)
  assert np.abs(got['w'] - first_only['w']).max() > 10 * 1e-6  # The rounding of nu shows.


def test_bfloat16_moments_take_less_optimizer_state():
  def state_bytes(mu_dtype, nu_dtype='float32'):
    config = tiny_config()
    config.optim.mu_dtype, config.optim.nu_dtype = mu_dtype, nu_dtype
    state = lay_out(config, 256, jax.devices()[:1]).abstract_state()
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state['opt_state']))

  full = state_bytes('float32')
  assert state_bytes('bfloat16') == pytest.approx(0.75 * full, rel=1e-3)  # mu halves.
  assert state_bytes('bfloat16', 'bfloat16') == pytest.approx(0.5 * full, rel=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_bfloat16_moments_match_single_device(mode):
  """Losses, gradient norms and parameters as tight as float32 moments; the first gradients,
  read back from the rounded moment, within one bfloat16 rounding (2^-8 of their scale)."""
  config = llama_config()
  config.optim.mu_dtype = 'bfloat16'
  reference = single_device_run(config, 2)
  sharded = llama_config((2, 2, 2))
  sharded.optim.mu_dtype, sharded.parallelism.mode = 'bfloat16', mode
  run = engine_run(sharded, mode, 2)
  np.testing.assert_allclose(run.losses, reference.losses, atol=ATOL, rtol=0)
  np.testing.assert_allclose(run.grad_norms, reference.grad_norms, rtol=ATOL, atol=0)
  for path, expected in reference.first_gradients.items():
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(run.first_gradients[path] / scale, expected / scale,
                               atol=2 ** -8, rtol=0, err_msg=path)
  for path, expected in reference.params.items():
    np.testing.assert_allclose(run.params[path], expected, atol=PARAM_ATOL, rtol=0, err_msg=path)


@pytest.mark.slow
def test_a_resumed_run_with_bfloat16_moments_continues_exactly(tmp_path):
  def config(steps, mu_dtype='bfloat16'):
    c = tiny_config(mesh=(2, 2, 2), steps=steps)
    c.optim.mu_dtype, c.optim.decay_steps = mu_dtype, 8
    c.train.checkpoint_every, c.train.async_checkpoints = 2, False
    return c

  # The moments' dtype may change between runs: float32 moments resume from the bfloat16 ones.
  assert_resumes_exactly(config, tmp_path, {'mu_dtype': 'float32'})
