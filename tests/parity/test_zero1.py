"""ZeRO-1 (parallelism.optimizer_sharding='zero1'): Adam's moments split over the batch axes their
parameter is replicated on. Both modes equal the single-device run on data 8, data x fsdp x
tensor, with micro-batches and with pipeline stages; a gradient reduce-scattered but not
averaged (the planted bug) fails that; the moments take 1 / data of the memory. Manual mode's
bytes against the theory: tests/parity/test_theory_meshes.py."""

import math

import jax
import pytest

from engine.assemble import lay_out
from engine.parallel import zero1
from engine.sharding import split_further
from jax.sharding import PartitionSpec as P
from tests.parity.test_llama import llama_config
from tests.support.helpers import assert_same_run, engine_run, single_device_run


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
@pytest.mark.parametrize('mode', ['auto', 'manual'])
@pytest.mark.parametrize('mesh, train_keys', [
    ((8, 1, 1), {}), ((2, 2, 2), {}), ((4, 1, 2), {'microbatches': 2}),
    ((2, 1, 2, 1, 2), {'microbatches': 2})],
    ids=['data8', 'data2_fsdp2_tensor2', 'microbatches', 'stage2'])
def test_zero1_matches_single_device(mode, mesh, train_keys, reference):
  config = _config(mesh[:3], mode, **train_keys)
  config.mesh.context, config.mesh.stage = (*mesh[3:], 1, 1)[:2]
  assert_same_run(engine_run(config, mode, 2), reference)


@pytest.mark.slow
def test_a_gradient_scattered_but_not_averaged_is_caught(reference, monkeypatch):
  original = zero1.reduced_gradient

  def summed(grad, param_spec, moment_spec, batch_axes, mesh_shape, reduce_dtype):
    mean = original(grad, param_spec, moment_spec, batch_axes, mesh_shape, reduce_dtype)
    return mean * 8 if zero1.split(param_spec, moment_spec)[0] else mean

  monkeypatch.setattr(zero1, 'reduced_gradient', summed)
  with pytest.raises(AssertionError):
    assert_same_run(engine_run(_config((8, 1, 1), 'manual'), 'manual', 2), reference)


def test_the_moments_take_one_data_share_of_the_memory():
  def moment_bytes(sharding):
    config = llama_config((8, 1, 1))
    config.parallelism.optimizer_sharding = sharding
    state = lay_out(config, 256, jax.devices()).abstract_state()
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(state['opt_state']) if x.ndim)

  assert moment_bytes('zero1') * 8 == moment_bytes('params')
