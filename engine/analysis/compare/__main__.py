"""Auto against manual on the same model, data, seed and mesh: numerics, speed, memory, bytes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.analysis.compare \
      --config=experiments/shakespeare_char.py:mesh=2x2x2 \
      --config.data.path=experiments/data/tinyshakespeare.txt --out=/tmp/compare --steps=10

Every mode starts from the same sharded initial state and sees the same batches; their steps are
interleaved so that machine drift hits all alike. After each step the parameters of each mode are
compared with the single-device reference (engine.analysis.reference) on the same batch. The
report is printed and written to OUT as report.md, report.json and PNG plots
(engine.analysis.compare.report).
"""

from __future__ import annotations

import math

from absl import flags
from ml_collections import config_flags

from engine.analysis import benchmark
from engine.analysis.compare import report as compare_report
from engine.analysis.compare.comparison import compare
from engine.cli.command_line import check_out_directory, define_alias, run_command
from engine.errors import ConfigError

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_OUT = flags.DEFINE_string('out', None, 'Directory for report.md, report.json and the plots.')
define_alias('workdir', 'out')  # Its earlier name.
_MODES = flags.DEFINE_list('modes', ['auto', 'manual'], 'Modes to compare, in order.')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps per mode, after --warmup steps.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed first steps (their numerics still count).')
_ATOL = flags.DEFINE_float(
    'atol', 1e-4, 'Largest difference from the single-device reference that still agrees: '
    'absolute for parameters and the loss, relative for gradient norms above 1.')


def main(argv):
  del argv
  benchmark.check_timing_flags(_STEPS.value, _WARMUP.value)
  if not (math.isfinite(_ATOL.value) and _ATOL.value > 0):
    raise ConfigError(f'--atol={_ATOL.value:g} must be a positive number (the '
                      'largest difference from the reference that agrees).')
  check_out_directory(_OUT.value)
  report = compare(_CONFIG.value, _OUT.value, _MODES.value, _STEPS.value, _WARMUP.value,
                   _ATOL.value)
  print(compare_report.markdown(report))


if __name__ == '__main__':
  run_command(main, 'engine.analysis.compare', required=('config', 'out'))


