"""Remat policies, gradient accumulation and mixed precision, in both modes, on the Llama model.

- Every remat policy computes the same float32 step (it only changes what is stored), and full
  remat needs less temporary memory than none.
- k micro-batches of b rows give the gradients of one batch of k*b rows, and manual mode
  synchronises each gradient once per optimizer step, not once per micro-batch (from the HLO).
- bfloat16 compute stays within a derived tolerance of the float32 single-device run, and
  manual mode moves its gradient reductions in the dtype asked for.
- The offloading remat policy, compiled for TPU, keeps its saved matmul outputs in host memory
  in both modes, and parallelism.offload_optimizer the optimizer state; XLA:CPU, which would drop
  the host memory space, refuses both in one line.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import parallel
from engine.analysis import collectives
from engine import assemble
from engine.assemble import lay_out
from engine.errors import ConfigError
from engine.parallel import manual_ops
from engine.plan import planner as plan_lib
from tests.support.helpers import (assert_same_run, compiled_train_step, engine_run,
                                   single_device_run, train_batches)
from tests.parity.test_llama import llama_config

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.


def _compiled(config, mode):
  train_setup, compiled = compiled_train_step(config, mode)
  return compiled, collectives.count_collectives(compiled.as_text(), train_setup.mesh)


@pytest.fixture(scope='module')
def reference():
  return single_device_run(llama_config(), 2)


@pytest.fixture(scope='module')
def manual_2x2x2():
  """Manual mode's step on 2x2x2, no remat, one micro-batch: (compiled, collectives)."""
  return _compiled(llama_config((2, 2, 2)), 'manual')


@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_remat_policies_change_memory_not_numbers(mode, reference, manual_2x2x2):
  losses, temp, first_state = {}, {}, None
  for policy in ('none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable'):
    config = llama_config((2, 2, 2))
    config.model.remat = policy
    if (mode, policy) == ('manual', 'none'):
      compiled = manual_2x2x2[0]
    else:
      compiled, _ = _compiled(config, mode)
    temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    train_setup = lay_out(config, 256)
    # The same initial state for every policy (the step donates it: each gets a copy).
    if first_state is None:
      first_state = train_setup.init(config.seed)[0]
    state = jax.tree.map(jnp.copy, first_state)
    _, batches = train_batches(config)
    losses[policy] = []
    for i in range(2):
      state, metrics = compiled(state, jax.device_put(batches[i], train_setup.batch_sharding()))
      losses[policy].append((float(metrics['loss']), float(metrics['grad_norm'])))
  for policy, values in losses.items():
    np.testing.assert_allclose(values, losses['none'], rtol=1e-6, err_msg=policy)
  np.testing.assert_allclose(np.array(losses['none'])[:, 0], reference.losses, atol=1e-5)
  assert temp['full'] < temp['none'], temp


@pytest.mark.parametrize('mode', ['auto', 'manual'])
@pytest.mark.parametrize('mesh', [(2, 2, 2), (8, 1, 1)], ids=['2x2x2', '8x1x1'])
def test_micro_batches_equal_one_large_batch(mesh, mode, reference):
  """Against the single-device run of whole batches: the same gradients and steps."""
  config = llama_config(mesh)
  config.train.microbatches = 2
  assert_same_run(engine_run(config, mode, 2), reference)


def _gradient_syncs(found):
  """Gradient reductions by kind: (executions per step, bytes per step)."""
  table = collectives.summarize(found)
  return {key: (row['executions'], row['array_bytes']) for key, row in table.items()
          if key[0] in ('reduce-scatter', 'all-reduce') and key[1] != ('tensor',)}


def test_manual_synchronises_each_gradient_once_per_step(manual_2x2x2):
  one = _gradient_syncs(manual_2x2x2[1])
  config = llama_config((2, 2, 2))
  config.train.microbatches = 4
  compiled, found = _compiled(config, 'manual')
  four = _gradient_syncs(found)
  # Same bytes as with one micro-batch, and nothing inside the micro-batch loop; but one
  # micro-batch looks tokens up on the embedding's columns, whose gradient then needs no
  # reduce-scatter, where the micro-batches share the table gathered once per step.
  [table] = [p for p in lay_out(config, 256).parameters()
             if tuple(p.logical_axes) == manual_ops.EMBEDDING_AXES]
  one[('reduce-scatter', ('fsdp',))] = (
      one[('reduce-scatter', ('fsdp',))][0], one[('reduce-scatter', ('fsdp',))][1]
      + math.prod(table.shard_shape) * 4)
  assert {k: v[1] for k, v in four.items()} == {k: v[1] for k, v in one.items()}, (one, four)
  assert all(c.executions == 1 for c in found
             if c.kind == 'reduce-scatter' or (c.kind == 'all-reduce' and c.axes != ('tensor',)))
  # Every weight is gathered once per step instead of twice per layer and micro-batch.
  assert all(c.executions == 1 for c in found if c.kind == 'all-gather')


# bfloat16 keeps 8 significant bits: one rounding moves a value by up to u = 2^-9 = 0.2 %. The
# gradient norm sums squares of gradients that each went through a few bf16-rounded matmuls, so
# its relative error is of order u (measured 2.0e-3 auto, 2.0e-3 manual, 2.3e-3 with bf16
# reductions): we allow 4u. The loss is a mean over 256 tokens whose rounding errors are
# independent, so it moves by much less than u (measured 1.1e-4): we allow u. A layout bug moves
# them by far more (an 8x gradient, a lost psum).
BF16_LOSS_RTOL, BF16_NORM_RTOL = 2 ** -9, 4 * 2 ** -9

STEPS_BF16 = 3


@pytest.fixture(scope='module')
def float32_reference():
  return single_device_run(llama_config(steps=STEPS_BF16), STEPS_BF16)


@pytest.mark.parametrize('mode, reduce_dtype', [('auto', 'float32'), ('manual', 'float32'),
                                                ('manual', 'bfloat16')])
def test_bfloat16_compute_stays_close_to_float32(mode, reduce_dtype, float32_reference):
  config = llama_config((2, 2, 2), steps=STEPS_BF16)
  config.model.dtype = 'bfloat16'
  config.parallelism.grad_reduce_dtype = reduce_dtype
  run = engine_run(config, mode, STEPS_BF16)
  np.testing.assert_allclose(run.losses, float32_reference.losses, rtol=BF16_LOSS_RTOL)
  np.testing.assert_allclose(run.grad_norms, float32_reference.grad_norms, rtol=BF16_NORM_RTOL)
  assert not np.allclose(run.losses, float32_reference.losses, rtol=1e-7, atol=0)  # Really bf16.


@pytest.mark.parametrize('reduce_dtype', ['float32', 'bfloat16'])
def test_manual_gradient_reductions_move_the_dtype_asked_for(reduce_dtype):
  """Read from the program manual mode writes (its jaxpr): XLA:CPU then promotes bfloat16
  all-reduces and reduce-scatters to float32; the TPU compiler keeps them."""
  config = llama_config((2, 2, 2))
  config.model.dtype = 'bfloat16'
  config.parallelism.grad_reduce_dtype = reduce_dtype
  train_setup = lay_out(config, 256)
  jaxpr = jax.make_jaxpr(parallel.build_steps('manual', train_setup).train)(
      train_setup.abstract_state(), train_setup.abstract_batch(16, 16))
  found = {(c.primitive, c.axes, c.dtype) for c in collectives.requested_collectives(jaxpr)
           if c.shape}  # Arrays, not the loss or norms.
  # The embedding's lookup gathers the fsdp group's int32 tokens, not a weight.
  assert ('all_gather', ('fsdp',), 'int32') in found
  gradients = {c for c in found if (c[0] in ('reduce_scatter', 'all_gather') or
                                    (c[0].startswith('psum') and 'tensor' not in c[1]))
               and c[2] != 'int32'}
  assert {dtype for _, _, dtype in gradients} == {reduce_dtype}, gradients
  assert {kind for kind, _, _ in gradients} == {'reduce_scatter', 'all_gather', 'psum_invariant'}
  # Tensor-parallel activations move in the compute dtype, the loss's vocab terms in float32.
  assert ('psum_invariant', ('tensor',), 'bfloat16') in found
  assert ('pmax', ('tensor',), 'float32') in found


@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_offloaded_activations_go_to_host_memory_on_tpu(mode):
  """Compiled for TPU v5p 2x2x2: the offloading policy moves values to the host memory space
  (S(5) in the HLO) and the compiler reserves host memory for them; the policy that keeps the
  same values in device memory moves none."""
  def compiled(remat):
    config = llama_config((2, 2, 2))
    config.model.remat, config.parallelism.mode = remat, mode
    setup = lay_out(config, 256, plan_lib.topology_devices('v5p:2x2x2'))
    return parallel.build_steps(mode, setup).train.lower(
        setup.abstract_state(), setup.abstract_batch(16, 16)).compile()

  offloaded, kept = (compiled(r) for r in ('offload_dots_with_no_batch_dims',
                                           'dots_with_no_batch_dims_saveable'))
  assert 'S(5)' in offloaded.as_text() and 'S(5)' not in kept.as_text()
  assert offloaded.memory_analysis().host_temp_size_in_bytes > 0
  assert kept.memory_analysis().host_temp_size_in_bytes == 0


@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_the_offloaded_optimizer_state_lives_in_host_memory_on_tpu(mode):
  """Compiled for TPU v5p 2x2x2: the step's optimizer state arrives from and returns to host
  memory: what leaves the devices' arguments is the host's, at least the state's bytes (TPU
  pads small arrays to its tiles)."""
  def memory(offload):
    config = llama_config((2, 2, 2))
    config.parallelism.offload_optimizer, config.parallelism.mode = offload, mode
    setup = lay_out(config, 256, plan_lib.topology_devices('v5p:2x2x2'))
    state = setup.abstract_state()
    compiled = parallel.build_steps(mode, setup).train.lower(
        state, setup.abstract_batch(16, 16)).compile()
    opt_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(state['opt_state']))
    return compiled.memory_analysis(), opt_bytes

  (offloaded, opt_bytes), (kept, _) = memory(True), memory(False)
  moved = kept.argument_size_in_bytes - offloaded.argument_size_in_bytes
  assert moved >= opt_bytes > 0
  assert offloaded.host_argument_size_in_bytes == offloaded.host_output_size_in_bytes == moved
  assert kept.host_argument_size_in_bytes == 0


@pytest.mark.parametrize('key, value', [('model.remat', 'offload_dots_with_no_batch_dims'),
                                        ('parallelism.offload_optimizer', True)])
def test_offloading_is_refused_on_cpu(key, value):
  config = llama_config((2, 2, 2))
  section, name = key.split('.')
  config[section][name] = value
  with pytest.raises(ConfigError, match='XLA:CPU does not separate from device memory'):
    assemble.check(config, jax.devices())
