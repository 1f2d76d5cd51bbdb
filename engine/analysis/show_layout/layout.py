"""Where the state and a batch live on the mesh, printed and drawn: the library of
`python -m engine.analysis.show_layout` (engine/analysis/show_layout/__main__.py, the command).

`print_layout` prints every parameter's shape, logical axes, PartitionSpec and bytes per device,
then draws the chosen parameter and the input batch with `visualize`.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.assemble import VOCABULARY, assemble
from engine.errors import ConfigError


def visualize(shape, named_sharding: NamedSharding) -> None:
  """Draws the sharding of an array of any rank as a 2-D picture of its sharded dimensions.

  jax.debug.visualize_sharding draws 1-D and 2-D arrays only, so higher-rank arrays are shown
  through the (up to) two dimensions that are split, or their last two."""
  spec = tuple(named_sharding.spec) + (None,) * (len(shape) - len(named_sharding.spec))
  split = [i for i, s in enumerate(spec) if s is not None][:2]
  rest = [i for i in reversed(range(len(shape))) if i not in split]
  dims = sorted(split + rest[:max(0, 2 - len(split))])
  # visualize_sharding draws 25 x (width / height) columns at scale 1 on an 80-column console;
  # wider, rich squeezes the cells and their labels vanish: scale the picture to 70 columns.
  jax.debug.visualize_sharding(tuple(shape[i] for i in dims),
                               NamedSharding(named_sharding.mesh, P(*(spec[i] for i in dims))),
                               scale=min(1.0, 2.8 * shape[dims[0]] / shape[dims[-1]]))


def print_layout(config, param: str | None = None) -> None:
  """The table of every parameter's layout, then the pictures of `param` (a path joined by '/';
  default: the largest parameter) and of the input batch."""
  train_setup = assemble(config, reads=VOCABULARY).setup
  params = train_setup.parameters()
  by_path = {p.path: p for p in params}
  name = param or max(params, key=lambda p: math.prod(p.shape)).path
  if name not in by_path:  # Before anything is printed: the error is the only line.
    raise ConfigError(f'--param={name} is not a parameter; choose one of '
                      f'{sorted(by_path)}.')
  print(f'mesh {dict(train_setup.mesh.shape)}')
  for p in params:
    print(f'{p.path:28s} {str(p.shape):22s} {str(p.logical_axes):46s} {str(p.spec):38s} '
          f'{p.bytes_per_device:>10,d} B')
  total = sum(p.bytes_per_device for p in params)
  print(f'parameters per device: {total:,d} B; with AdamW moments: {3 * total:,d} B')
  chosen = by_path[name]
  print(f'\n{chosen.path} {chosen.shape} {chosen.spec}:')
  visualize(chosen.shape, NamedSharding(train_setup.mesh, chosen.spec))
  batch = train_setup.batch_sharding()
  shape = (config.data.global_batch_size, config.data.seq_len + 1)
  print(f'\ninput batch {shape} {batch.spec}:')
  visualize(shape, batch)
