"""What a grouped matmul costs when only some of its rows are in groups: the dropless experts'
exchange leaves each device a buffer sized for the worst routing, whose unused rows are in no
group (engine/parallel/expert_exchange.py). Times `jax.lax.ragged_dot` of [rows, width] by
[experts, width, hidden] with 1, 1/2, 1/4 and 1/8 of the rows in the experts' groups (equal
groups), forward and the weights' gradient, against one dense [rows, width] x [width, hidden]
product; medians of --repeats calls after a warm-up, on the default device.

  python -m engine.bench.grouped_matmul [--rows=16384 --width=4096 --hidden=1024 --experts=8]

On a TPU the time falls with the rows in use (the kernel visits only the groups' tiles); XLA:CPU
multiplies every row by every expert whatever the groups say (docs/benchmarks.md).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags

_ROWS = flags.DEFINE_integer('rows', 16384, 'Rows of the grouped operand.')
_WIDTH = flags.DEFINE_integer('width', 4096, 'Contracted width.')
_HIDDEN = flags.DEFINE_integer('hidden', 1024, "Each expert's output width.")
_EXPERTS = flags.DEFINE_integer('experts', 8, 'Groups (experts).')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per variant.')


def median_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * sorted(times)[len(times) // 2]


def main(argv):
  del argv
  rows, width, hidden, experts = _ROWS.value, _WIDTH.value, _HIDDEN.value, _EXPERTS.value
  x = jnp.ones((rows, width), jnp.bfloat16)
  w = jnp.ones((experts, width, hidden), jnp.bfloat16)
  forward = jax.jit(jax.lax.ragged_dot)
  weights_gradient = jax.jit(lambda x, w, sizes: jax.grad(
      lambda w: jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32).sum())(w))
  dense = median_ms(jax.jit(lambda x, w: x @ w[0]), x, w, repeats=_REPEATS.value)
  print(f'{jax.devices()[0].device_kind}: ragged_dot [{rows}, {width}] x [{experts}, {width}, '
        f'{hidden}] bfloat16; one dense product of every row: {dense:.2f} ms')
  print('| rows in groups | forward ms | weights gradient ms |\n|---:|---:|---:|')
  for share in (1, 2, 4, 8):
    sizes = jnp.full((experts,), rows // share // experts, jnp.int32)
    print(f'| 1/{share} | {median_ms(forward, x, w, sizes, repeats=_REPEATS.value):.2f} | '
          f'{median_ms(weights_gradient, x, w, sizes, repeats=_REPEATS.value):.2f} |')


if __name__ == '__main__':
  app.run(main)
