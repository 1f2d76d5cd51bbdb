"""The FLOP/s per device that a plain matmul reaches on this machine: what the bench sets a
model's achieved FLOP/s against where no chip table gives a peak (CPUs, unknown chips), and a
check of that table where one does.

Every device multiplies one [n, n] x [n, n] pair at once (a batched matmul whose batch axis is
split over all devices), in the model's dtype, for a few sizes n; the best is the largest, over
sizes, of the median over a few repeats. All devices at once, because that is how a training
step runs them: simulated CPU devices share the machine's cores, so one device alone would
reach several times what each reaches while all are busy, and a GPU or TPU shares its host.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

# Sizes tried, smallest first; a larger one is skipped once the last one's time predicts that it
# would take more than MAX_SECONDS_PER_CALL (8x the FLOPs each time n doubles).
SIZES = (256, 512, 1024, 2048, 4096)
MAX_SECONDS_PER_CALL = 0.1
REPEATS = 3  # Timed calls per size, after one untimed (the first call compiles).


def matmul_flops_per_device(dtype: str, devices=None) -> float:
  """The best FLOP/s per device of a [n, n] x [n, n] matmul on every device at once."""
  devices = list(devices if devices is not None else jax.devices())
  sharding = NamedSharding(jax.sharding.Mesh(np.array(devices), ('batch',)),
                           PartitionSpec('batch'))
  best, last_seconds = 0.0, 0.0
  for n in SIZES:
    if last_seconds * 8 > MAX_SECONDS_PER_CALL:
      break
    last_seconds = _median_seconds(n, len(devices), jnp.dtype(dtype), sharding)
    best = max(best, 2 * n**3 / last_seconds)
    logging.info('Calibration: %d x [%d, %d] matmuls in %.2f ms, %.3f TFLOP/s per device.',
                 len(devices), n, n, 1e3 * last_seconds, 2 * n**3 / last_seconds / 1e12)
  return best


def _median_seconds(n: int, count: int, dtype, sharding) -> float:
  """The median time of one batched matmul of `count` [n, n] pairs, one pair per device."""
  make = jax.jit(lambda key: jax.random.normal(key, (2, count, n, n), dtype),
                 out_shardings=NamedSharding(sharding.mesh, PartitionSpec(None, 'batch')))
  pair = make(jax.random.key(0))
  matmul = jax.jit(lambda ab: jnp.matmul(ab[0], ab[1]), out_shardings=sharding)
  jax.block_until_ready(matmul(pair))  # Compiles.
  seconds = []
  for _ in range(REPEATS):
    start = time.perf_counter()
    jax.block_until_ready(matmul(pair))
    seconds.append(time.perf_counter() - start)
  return float(np.median(seconds))
