"""ZeRO-1 (parallelism.optimizer_sharding='zero1'): Adam's moments split over the batch axes their
parameter is replicated on. Both modes equal the single-device run on data 8 and data x fsdp x
tensor, manual mode with micro-batches and with pipeline stages too; a gradient reduce-scattered
but not averaged (the planted bug) fails that; the moments take 1 / data of the memory; the
gradients step returns whole gradients; runs resume exactly. Manual mode's bytes against the
theory: tests/parity/test_theory_meshes.py."""

import math

import jax
import numpy as np
import pytest

from engine import parallel
from engine.assemble import lay_out
from engine.parallel import zero1
from engine.sharding import split_further
from jax.sharding import PartitionSpec as P
from tests.parity.test_llama import llama_config
from tests.support.helpers import (assert_resumes_exactly, assert_same_run, compiled_train_step,
                                   engine_run, single_device_run, train_batches)


def _config(mesh=(1, 1, 1), mode='auto', **train_keys):
  config = llama_config(mesh)
  config.parallelism.optimizer_sharding, config.parallelism.mode = 'zero1', mode
  config.train.update(train_keys)
  return config


@pytest.fixture(scope='module')
def reference():
  return single_device_run(llama_config(), 2)


def test_a_moment_takes_the_batch_axes_on_its_first_dimension_that_divides():
  mesh = {'data': 4, 'fsdp': 2, 'tensor': 1}
  assert split_further(P(None, 'tensor'), (6, 12), ('data', 'fsdp'), mesh) == P(None, 'tensor')
  assert split_further(P('fsdp', None), (16, 3), ('data', 'fsdp'), mesh) == P(('fsdp', 'data'),
                                                                              None)
  assert split_further(P(), (6, 8), ('data',), mesh) == P(None, 'data')
  assert split_further(P(), (3,), ('data',), mesh) == P()  # Nothing divides: kept whole.
  assert zero1.split(P('fsdp'), P(('fsdp', 'data'))) == (('data',), 0)


@pytest.mark.slow
@pytest.mark.parametrize('mode, mesh, train_keys', [
    ('auto', (8, 1, 1), {}), ('manual', (8, 1, 1), {}), ('auto', (2, 2, 2), {}),
    ('manual', (2, 2, 2), {}), ('manual', (4, 1, 2), {'microbatches': 2}),
    ('manual', (2, 1, 2, 1, 2), {'microbatches': 2})],
    ids=['data8-auto', 'data8-manual', 'data2_fsdp2_tensor2-auto', 'data2_fsdp2_tensor2-manual',
         'microbatches-manual', 'stage2-manual'])
def test_zero1_matches_single_device(mode, mesh, train_keys, reference):
  """Both modes on data 8 and data x fsdp x tensor; manual mode's other gradient paths
  (accumulated micro-batches, the pipeline's synchronisation after its schedule) too."""
  config = _config(mesh[:3], mode, **train_keys)
  config.mesh.context, config.mesh.stage = (*mesh[3:], 1, 1)[:2]
  assert_same_run(engine_run(config, mode, 2), reference)


@pytest.mark.slow
def test_a_gradient_scattered_but_not_averaged_is_caught(reference, monkeypatch):
  original = zero1.reduced_gradient

  def summed(grad, param_spec, moment_spec, *rest):
    mean = original(grad, param_spec, moment_spec, *rest)
    return mean * 8 if zero1.split(param_spec, moment_spec)[0] else mean

  monkeypatch.setattr(zero1, 'reduced_gradient', summed)
  with pytest.raises(AssertionError):
    assert_same_run(engine_run(_config((8, 1, 1), 'manual'), 'manual', 2), reference)


@pytest.mark.slow
def test_the_moments_take_one_data_share_of_the_memory():
  """On data 8 each device holds 1/8 of every moment (the tiny model's dimensions all divide),
  and the compiled step's arguments shrink by the other 7/8, in both modes."""
  def memory(sharding, mode):
    config = _config((8, 1, 1), mode)
    config.parallelism.optimizer_sharding = sharding
    setup, compiled = compiled_train_step(config, mode)
    moments = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                  for x in jax.tree.leaves(setup.abstract_state()['opt_state']) if x.ndim)
    return moments, compiled.memory_analysis().argument_size_in_bytes

  for mode in ('auto', 'manual'):
    (split, split_args), (whole, whole_args) = memory('zero1', mode), memory('params', mode)
    assert split * 8 == whole
    assert whole_args - split_args == whole - split


@pytest.mark.slow
def test_the_gradients_step_returns_whole_gradients():
  """Manual mode's gradients step under ZeRO-1 hands the reduced blocks back as whole arrays:
  the gradients of the same parameters and batch without it."""
  def gradients(sharding):
    config = _config((8, 1, 1), 'manual')
    config.parallelism.optimizer_sharding = sharding
    setup = lay_out(config, 256, jax.devices())
    params = setup.init(0)[0]['params']
    batch = jax.device_put(train_batches(config)[1][0], setup.batch_sharding())
    return jax.device_get(parallel.build_steps('manual', setup).gradients(params, batch))

  (loss, grads), (want_loss, want) = gradients('zero1'), gradients('params')
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * max(1.0, float(np.abs(w).max())))


@pytest.mark.slow
def test_a_zero1_run_resumes_exactly_and_without_it(tmp_path):
  def config(steps, sharding='zero1'):
    c = _config((8, 1, 1), 'manual')
    c.train.num_steps, c.optim.decay_steps = steps, 8
    c.parallelism.optimizer_sharding = sharding
    c.train.checkpoint_every, c.train.async_checkpoints = 2, False
    return c

  # The moments laid out as their parameters again: restored from the ZeRO-1 blocks.
  assert_resumes_exactly(config, tmp_path, {'sharding': 'params'})
