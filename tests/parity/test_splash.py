"""model.attention='splash': the Pallas TPU splash-attention kernel
(engine/models/attention/splash.py).

On CPU the kernel runs in Pallas interpret mode; its training runs must match the single-device
einsum reference (engine.analysis.reference: losses, gradient norms, every gradient, every
parameter; tolerance 1e-5, tests/support/helpers.py; the kernel's float32 attention agrees with the
einsum path to about 1e-6). Compiled for a TPU topology (libtpu's compiler, on CPU), the step
must call the kernel (tpu_custom_call) and keep no [L, L] float32 probabilities. With context
parallelism (manual mode) ring attention runs the kernel per block and merges by log-sum-exp.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from engine import parallel
from engine.analysis import collectives, comm_theory
from engine.plan import planner as plan_lib
from engine.assemble import lay_out
from engine.models.attention import causal as attention
from engine.models.attention.spec import AttentionSpec
from engine.models.attention import splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
from tests.support.helpers import (assert_same_run, compiled_run, engine_run, single_device_run,
                                   tiny_config)

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

TOPOLOGY = 'v5p:2x2x2'


def _config(model, implementation, mesh=(2, 2, 2), stages=1):
  config = tiny_config(mesh=mesh, steps=1)
  config.model.name = model
  config.model.attention = implementation
  config.mesh.stage = stages
  # 256 positions: two of the kernel's 128-position tiles, so it skips a block above the
  # diagonal and carries its running softmax across blocks.
  config.data.seq_len = config.model.max_len = 256
  config.data.global_batch_size = 8
  if model == 'llama':
    config.model.num_kv_heads = 2
  return config


@pytest.mark.parametrize('model,mode,mesh,stages', [
    ('llama', 'manual', (2, 2, 2), 1), ('llama', 'auto', (2, 2, 2), 1),
    # The auto pipeline runs the stages under vmap: the kernel's shard_map inside it.
    ('gpt', 'auto', (2, 2, 1), 2)])
def test_splash_trains_like_the_einsum_reference(model, mode, mesh, stages):
  assert splash.block_size(256) == 256 and splash.block_size(384) == 128
  reference = single_device_run(_config(model, 'einsum', mesh, stages), 1)
  assert_same_run(engine_run(_config(model, 'splash', mesh, stages), mode, 1), reference)


def test_the_tpu_train_step_calls_the_kernel():
  config = _config('llama', 'splash')
  # head_dim 128; no weight is [256, 256] (the vocabulary has 256 ids), so only attention
  # probabilities could make such a buffer.
  config.model.embed_dim, config.model.mlp_dim = 512, 1024
  train_setup = lay_out(config, 256, plan_lib.topology_devices(TOPOLOGY))
  hlo = parallel.build_steps('auto', train_setup).train.lower(
      train_setup.abstract_state(), train_setup.abstract_batch(8, 256)).compile().as_text()
  assert 'tpu_custom_call' in hlo
  assert not re.search(r'f32\[[0-9,]*256,256\]', hlo)


def _attention_gradients(implementation, device):
  """Attention forward and backward of one [1, 2048, 8, 128] bfloat16 batch row, compiled."""
  shape = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16,
                               sharding=SingleDeviceSharding(device))
  loss = lambda q, k, v: attention.causal_attention(
      q, k, v, AttentionSpec(implementation)).astype(jnp.float32).sum()
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()


def test_splash_keeps_no_probabilities_on_tpu():
  device = plan_lib.topology_devices(TOPOLOGY)[0]
  einsum, kernel = (_attention_gradients(i, device) for i in ('einsum', 'splash'))
  square = r'f32\[[0-9,]*2048,2048\]'
  assert re.search(square, einsum.as_text()) and not re.search(square, kernel.as_text())
  # Three kernels: the forward pass, then dq and dk / dv; the backward reuses the forward's
  # residuals instead of running it again.
  assert kernel.as_text().count('custom_call_target="tpu_custom_call"') == 3
  # Measured: einsum 256 MiB of temporaries (the [8, 2048, 2048] float32 probabilities and
  # logits), splash 9 MiB.
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  assert temp(kernel) * 10 < temp(einsum)


def _ring_config(length):
  """One layer of grouped-query Llama, manual mode on data 4 x context 2."""
  config = _config('llama', 'splash', mesh=(4, 1, 1))
  config.parallelism.mode = 'manual'
  config.mesh.context = 2
  config.model.num_layers = 1
  config.data.seq_len = config.model.max_len = length
  return config


def test_splash_ring_trains_like_the_einsum_reference_and_moves_the_same_bytes():
  """Manual mode, data 4 x context 2: 512 positions in 4 zigzag chunks of 128 (the kernel's
  smallest tile), so each device runs it on diagonal (causal) and visible (full) blocks. One
  layer of grouped-query Llama (4 query, 2 key / value heads): losses, gradients and parameters
  match the single-device einsum run; the ring's permutes are the comm theory's bytes."""
  # The kernel's private backward passes the ring's blocks call (engine/models/attention/splash.py).
  assert hasattr(splash_attention_kernel, '_splash_attention_bwd_dkv')
  assert hasattr(splash_attention_kernel, '_splash_attention_bwd_dq')
  config = _ring_config(512)
  run, train_setup, compiled = compiled_run(config, 'manual', 1)
  config.model.attention = 'einsum'
  assert_same_run(run, single_device_run(config, 1))
  table = collectives.summarize(collectives.count_collectives(compiled.as_text(),
                                                              train_setup.mesh))
  theory = comm_theory.expected_bytes(train_setup, 8, 512)
  ring = ('collective-permute', ('context',))
  # Keys and values [2 rows, 256 positions, 2 heads, 8] float32, forward and backward.
  assert table[ring]['array_bytes'] == theory[ring] == 2 * 2 * 2 * 256 * 2 * 8 * 4
  assert {key: row['array_bytes'] for key, row in table.items()} == theory


def test_the_tpu_ring_calls_the_kernel_per_block():
  """Manual mode, data 4 x context 2 on v5p:2x2x2, one layer, 1024 positions in chunks of 256:
  each device runs 5 blocks (3 on its own keys, 2 of the visiting ones), each through the
  forward kernel and the two backward ones (dk / dv, dq), and keeps no [256, 256] float32
  block of probabilities (head_dim 128; no weight has two 256 dimensions)."""
  config = _ring_config(1024)
  config.model.embed_dim, config.model.mlp_dim = 512, 1024
  train_setup = lay_out(config, 256, plan_lib.topology_devices(TOPOLOGY))
  hlo = parallel.build_steps('manual', train_setup).train.lower(
      train_setup.abstract_state(), train_setup.abstract_batch(8, 1024)).compile().as_text()
  assert hlo.count('custom_call_target="tpu_custom_call"') == 5 * 3
  assert not re.search(r'f32\[[0-9,]*256,256\]', hlo)
