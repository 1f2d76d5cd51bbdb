"""Manual FSDP's quantized weight gathers (engine/parallel/quantized_gather.py): what a device
receives is NumPy's quantization of each shard, dequantized; the gradient is the unquantized
gather's (straight through); and the compiled step sends 1-byte values, never the wider type."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from engine.analysis import collectives
from engine.parallel import quantized_gather
from tests.support.helpers import compiled_train_step, tiny_config

_SPLITS = [(0, ('fsdp',))]  # The weight's first dimension, over 4 devices.


def _numpy_gathered(w: np.ndarray, fmt: str, shards: int) -> np.ndarray:
  """Each shard of rows quantized per column (absmax -> 127 / 448), then dequantized."""
  out = []
  for shard in np.split(w.astype(np.float32), shards, axis=0):
    largest = 127.0 if fmt == 'int8' else 448.0
    scale = np.abs(shard).max(axis=0, keepdims=True) / np.float32(largest)
    scaled = np.clip(shard / scale, -largest, largest)
    values = np.round(scaled) if fmt == 'int8' else scaled.astype(
        ml_dtypes.float8_e4m3fn).astype(np.float32)
    out.append(values * scale)
  return np.concatenate(out)


def _gathered_and_gradient(w, dy, fmt):
  mesh = jax.make_mesh((4,), ('fsdp',), axis_types=(AxisType.Auto,))

  def body(w_shard, dy):
    gathered, vjp = jax.vjp(lambda w: quantized_gather.gather(
        w, _SPLITS, fmt, jnp.float32, jnp.float32) if fmt else jax.lax.all_gather(
            w, 'fsdp', axis=0, tiled=True), w_shard)
    return gathered, vjp(dy)[0]

  # Every device's gathered weight, stacked: device 0's first.
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P('fsdp'), P('fsdp')),
                               out_specs=(P('fsdp'), P('fsdp'))))
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P('fsdp')))
  gathered, grad = [np.asarray(a) for a in step(put(w), put(dy))]
  return gathered[:w.shape[0]], grad


@pytest.mark.parametrize('fmt', ['int8', 'fp8'])
def test_gathered_weight_is_numpys_quantization_and_gradient_passes_straight(fmt):
  w = np.asarray(jax.random.normal(jax.random.key(0), (32, 24)))
  # Each device's cotangent of the whole gathered weight: their sum is the gradient.
  dy = np.asarray(jax.random.normal(jax.random.key(1), (4 * 32, 24)))
  gathered, grad = _gathered_and_gradient(w, dy, fmt)
  expected = _numpy_gathered(w, fmt, 4)
  np.testing.assert_allclose(gathered, expected, rtol=1e-6, atol=0)
  assert np.abs(gathered - w).max() > 1e-3  # Quantized: not the weight itself.
  _, plain_grad = _gathered_and_gradient(w, dy, None)
  np.testing.assert_allclose(grad, plain_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('fmt, dtype', [('int8', 's8'), ('fp8', 'u8')])
def test_compiled_gathers_send_one_byte_values(fmt, dtype):
  """Every all-gather over fsdp of the step sends a 1-byte type (fp8 as its bytes) or float32
  scales, one per shard and channel (a quarter of a byte per value here); as many values as the unquantized gathers send (which
  XLA:CPU widens to float32 whatever the dtype asked for). engine.compare's theory check of the
  bytes: tests/parity/test_theory_meshes.py."""
  # fsdp 2: a shard holds 16 of the width's 32 rows, one float32 scale each per column (4 / 16
  # of a byte per value; at fsdp 8 the 4-row shards' scales would cost as much as the values).
  config = tiny_config(mesh=(4, 2, 1))
  config.model.dtype = config.parallelism.grad_reduce_dtype = 'bfloat16'
  config.model.remat = 'full'  # Both gather again in the backward pass.
  found = {}
  for gather_dtype in ('default', fmt):
    config.parallelism.gather_dtype = gather_dtype
    setup, compiled = compiled_train_step(config, 'manual')
    found[gather_dtype] = [c for c in collectives.count_collectives(compiled.as_text(), setup.mesh)
                           if c.kind == 'all-gather' and c.axes == ('fsdp',)]
  sent = lambda gathers, t: sum(c.executions * b for c in gathers
                                for b, d in zip(c.buffer_bytes, c.dtypes) if d == t)
  quantized, plain = found[fmt], found['default']
  assert {d for c in quantized for d in c.dtypes} <= {dtype, 'f32'}
  plain_values = sent(plain, 'f32') // 4 + sent(plain, 'bf16') // 2
  # One byte each; as many values give or take a bias (the unquantized backward pass does not
  # gather a bias again, as its gradient needs none).
  assert 0.99 < sent(quantized, dtype) / plain_values < 1.01
  assert 0 < sent(quantized, 'f32') <= sent(quantized, dtype) / 4  # The scales.
