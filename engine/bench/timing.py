"""The median wall time of a jitted call, for the small benchmark commands."""

from __future__ import annotations

import time

import jax


def median_ms(fn, *args, repeats: int) -> float:
  """Milliseconds of the median of `repeats` calls of `fn(*args)`, after one warm-up call (its
  compile)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[len(times) // 2]
