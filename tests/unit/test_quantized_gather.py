"""Manual FSDP's quantized weight gathers (engine/parallel/quantized_gather.py): what a device
receives is NumPy's per-channel quantization of the whole weight, dequantized; the gradient is
the unquantized gather's (straight through); and the compiled step sends 1-byte values, never
the wider type."""

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


def _numpy_gathered(w: np.ndarray, fmt: str) -> np.ndarray:
  """w quantized per column (absmax over all rows -> 127 / 448), then dequantized."""
  w = w.astype(np.float32)
  largest = 127.0 if fmt == 'int8' else 448.0
  scale = np.abs(w).max(axis=0, keepdims=True) / np.float32(largest)
  scaled = np.clip(w / scale, -largest, largest)
  values = np.round(scaled) if fmt == 'int8' else scaled.astype(
      ml_dtypes.float8_e4m3fn).astype(np.float32)
  return values * scale


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
  expected = _numpy_gathered(w, fmt)
  np.testing.assert_allclose(gathered, expected, rtol=1e-6, atol=0)
  assert np.abs(gathered - w).max() > 1e-3  # Quantized: not the weight itself.
  _, plain_grad = _gathered_and_gradient(w, dy, None)
  np.testing.assert_allclose(grad, plain_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('fmt, dtype', [('int8', 's8'), ('fp8', 'u8')])
def test_compiled_gathers_send_one_byte_values(fmt, dtype):
  """Every all-gather over fsdp of the step sends a 1-byte type (fp8 as its bytes), as many
  values as the unquantized gathers send (which XLA:CPU widens to float32 whatever the dtype
  asked for); the scales go by all-reduce, 4 bytes per channel. engine.compare's theory check
  of the bytes: tests/parity/test_theory_meshes.py."""
  config = tiny_config(mesh=(1, 8, 1))
  config.model.dtype = config.parallelism.grad_reduce_dtype = 'bfloat16'
  config.model.remat = 'full'  # Both gather again in the backward pass.
  found = {}
  for gather_dtype in ('default', fmt):
    config.parallelism.gather_dtype = gather_dtype
    setup, compiled = compiled_train_step(config, 'manual')
    found[gather_dtype] = collectives.summarize(
        collectives.count_collectives(compiled.as_text(), setup.mesh))
  gathered = {g: table[('all-gather', ('fsdp',))]['dtype_bytes'] for g, table in found.items()}
  assert set(gathered[fmt]) == {dtype}
  plain_values = gathered['default'].get('f32', 0) // 4 + gathered['default'].get('bf16', 0) // 2
  # As many values, one byte each, give or take a bias (the unquantized backward pass does not
  # gather a bias again, as its gradient needs none).
  assert 0.99 < gathered[fmt][dtype] / plain_values < 1.01
  scales = (found[fmt][('all-reduce', ('fsdp',))]['array_bytes']
            - found['default'].get(('all-reduce', ('fsdp',)), {}).get('array_bytes', 0))
  assert 0 < scales < gathered[fmt][dtype] / 4
