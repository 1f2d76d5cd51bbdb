"""Shows how the state and a batch are laid out on the mesh.

  python -m engine.analysis.show_layout --config=experiments/tiny.py:mesh=2x2x2 \
      --param=blocks/w_up_DF

(with XLA_FLAGS=--xla_force_host_platform_device_count=8 to simulate 8 devices on CPU). Prints
every parameter's shape, logical axes, PartitionSpec and bytes per device, then
`jax.debug.visualize_sharding` of the chosen parameter (by default the largest) and of the input
batch.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from engine.analysis.show_layout.layout import print_layout
from engine.cli.command_line import run_command

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_PARAM = flags.DEFINE_string('param', None, "Parameter to draw, path joined by '/' "
                             '(default: the largest).')


def main(argv):
  del argv
  print_layout(_CONFIG.value, _PARAM.value)


if __name__ == '__main__':
  run_command(main, 'engine.analysis.show_layout', required=('config',))


