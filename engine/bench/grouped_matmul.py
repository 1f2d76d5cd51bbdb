"""What a grouped matmul costs when only some of its rows are in groups: the dropless experts'
exchange leaves each device a buffer sized for the worst routing, whose unused rows are in no
group (engine/parallel/expert_exchange.py). Times `jax.lax.ragged_dot` of [rows, width] by
[experts, width, hidden] with 1, 1/2, 1/4 and 1/8 of the rows in the experts' groups (equal
groups), forward and the weights' gradient, against one dense [rows, width] x [width, hidden]
product; medians of --repeats calls after a warm-up, on the default device. `--implementations`
adds the CPU dispatch's tiled grouped matmul (engine/models/moe/tiled_ragged_dot.py), its columns
beside ragged_dot's.

  python -m engine.bench.grouped_matmul [--rows=16384 --width=4096 --hidden=1024 --experts=8]
      [--implementations=ragged_dot,tiled]

On a TPU the time falls with the rows in use (the kernel visits only the groups' tiles); XLA:CPU
multiplies every row by every expert whatever the groups say, which the tiled one does not
(docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from engine.bench.timing import median_ms
from engine.models.moe.tiled_ragged_dot import tiled_ragged_dot

IMPLEMENTATIONS = {'ragged_dot': jax.lax.ragged_dot, 'tiled': tiled_ragged_dot}

_ROWS = flags.DEFINE_integer('rows', 16384, 'Rows of the grouped operand.')
_WIDTH = flags.DEFINE_integer('width', 4096, 'Contracted width.')
_HIDDEN = flags.DEFINE_integer('hidden', 1024, "Each expert's output width.")
_EXPERTS = flags.DEFINE_integer('experts', 8, 'Groups (experts).')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per variant.')
_IMPLEMENTATIONS = flags.DEFINE_list('implementations', ['ragged_dot'],
                                     f'Grouped matmuls to time: {", ".join(IMPLEMENTATIONS)}.')


def main(argv):
  del argv
  rows, width, hidden, experts = _ROWS.value, _WIDTH.value, _HIDDEN.value, _EXPERTS.value
  unknown = sorted(set(_IMPLEMENTATIONS.value) - set(IMPLEMENTATIONS))
  if unknown:
    raise app.UsageError(f'--implementations: unknown {unknown}; choose from '
                         f'{", ".join(IMPLEMENTATIONS)}.')
  x = jnp.ones((rows, width), jnp.bfloat16)
  w = jnp.ones((experts, width, hidden), jnp.bfloat16)
  timed = [(name, *_timed(IMPLEMENTATIONS[name])) for name in _IMPLEMENTATIONS.value]
  dense = median_ms(jax.jit(lambda x, w: x @ w[0]), x, w, repeats=_REPEATS.value)
  print(f'{jax.devices()[0].device_kind}: grouped matmul [{rows}, {width}] x [{experts}, {width}, '
        f'{hidden}] bfloat16; one dense product of every row: {dense:.2f} ms')
  print('| rows in groups | ' + ' | '.join(f'{name} forward ms | {name} weights gradient ms'
                                           for name, *_ in timed) + ' |')
  print('|---:|' + '---:|---:|' * len(timed))
  for share in (1, 2, 4, 8):
    sizes = jnp.full((experts,), rows // share // experts, jnp.int32)
    cells = [f'{median_ms(f, x, w, sizes, repeats=_REPEATS.value):.2f}'
             for _, *fns in timed for f in fns]
    print(f'| 1/{share} | ' + ' | '.join(cells) + ' |')


def _timed(matmul):
  """(forward, the weights' gradient) of `matmul`, jitted."""
  weights_gradient = lambda x, w, sizes: jax.grad(
      lambda w: matmul(x, w, sizes).astype(jnp.float32).sum())(w)
  return jax.jit(matmul), jax.jit(weights_gradient)


if __name__ == '__main__':
  app.run(main)
