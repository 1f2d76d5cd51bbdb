"""Sweeps: every combination of a grid of config values trained, each in its own workdir.

  python -m engine.sweep --config=experiments/tiny.py --config.train.num_steps=100 \
      --grid=optim.learning_rate=1e-3,3e-3 --grid=model.num_layers=2,4 --workdir=/tmp/sweep

Each variant runs as `python -m engine.main --config=EXP [the sweep's --config.* flags] [the
variant's values] --workdir=DIR/<variant>`, one after another (--print_commands prints those
command lines, for a launcher, and runs nothing). `mode` is short for parallelism.mode and `mesh`
for the mesh (e.g. --grid=mesh=8x1x1,2x2x2). Every variant's config is checked before the first
starts, in a short child process (so that this one never holds the accelerators): a bad one is
one `error:` line. While a variant runs, its step and time left are logged every 15 s (from its
metrics.jsonl). DIR/sweep.json records each variant's status; a rerun skips the finished
ones and resumes the others from their checkpoints. A failed variant is recorded (exit status,
last error line; its output is in DIR/logs/<variant>.log) and the sweep goes on; the exit status
is 1 if any failed. SIGTERM or SIGINT stops the running variant after a checkpoint (recorded
as preempted) and the sweep. At the end: DIR/sweep.md and DIR/sweep.csv (final train loss, final
and best eval loss, median tokens/s, peak memory, status; the best variant, the lowest final eval
loss of the finished ones, marked), printed too, DIR/loss_curves.png (every variant's curves) and
DIR/final_loss.png (the final losses against each swept value).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from absl import flags
from ml_collections import config_flags

from engine.sweep import grid as sweep_grid
from engine.sweep import report as sweep_report
from engine.sweep import runner
from engine.cli.argv import config_overrides, fail, flag_value
from engine.cli.command_line import run_command

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file, optionally '
                                          'with :arg.', lock_config=False)
_GRID = flags.DEFINE_multi_string('grid', [], 'KEY=V1,V2,...: a config key (or mode, mesh) and '
                                  'its values; repeat for more keys (every combination runs).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory of the sweep: one workdir per variant, '
                               'sweep.json, the table and the plot; rerun with it to resume.')
_PRINT = flags.DEFINE_bool('print_commands', False, "Print each variant's engine.main command "
                           'line (for a launcher) and exit; the configs are checked, but not '
                           'against this machine\'s devices.')
_CHECK_ONLY = flags.DEFINE_bool('check_only', False, "Check every variant's config against this "
                                "machine's devices, then exit.")


def _configs(variants) -> list:
  """Every variant's config (a value of the wrong type is refused here)."""
  return [sweep_grid.variant_config(_CONFIG.value, variant) for variant in variants]


def main(argv):
  del argv
  variants = sweep_grid.variants(sweep_grid.parse_grid(_GRID.value))
  configs = _configs(variants)
  if _CHECK_ONLY.value:
    return runner.check_on_devices(variants, configs)
  directory = _WORKDIR.value
  runner.check_workdir(directory)
  experiment = flag_value(sys.argv, 'config')
  base = config_overrides(sys.argv)
  commands = [sweep_grid.command(experiment, base, v, os.path.join(directory, v.name))
              for v in variants]
  if _PRINT.value:
    print('\n'.join(shlex.join(c) for c in commands))
    return
  check = subprocess.run([sys.executable, '-m', 'engine.sweep', *sys.argv[1:], '--check_only'],
                         check=False)
  if check.returncode:
    sys.exit(check.returncode)  # The child said why, in one line.
  os.makedirs(directory, exist_ok=True)
  signal.signal(signal.SIGTERM, runner.stop)
  try:
    state = runner.run_all(directory, variants, configs, commands)
  except runner.Stopped as stopped:
    running = stopped.args[0] if stopped.args else 'a variant'
    fail(f'stopped by a signal while {running} ran (recorded as preempted in '
         f'{os.path.join(directory, runner.STATE_FILE)}); rerun the same command to resume it '
         'from its checkpoint.', 1)
  workdirs = {v.name: os.path.join(directory, v.name) for v in variants}
  rows = {name: sweep_report.results(workdirs[name], state.get(name, {}).get('status', '-'))
          for name in workdirs}
  values = {v.name: v.values for v in variants}
  print(sweep_report.write_all(directory, rows, workdirs, values), end='')
  failed = [name for name, row in rows.items() if row['status'] != 'finished']
  if failed:
    fail(f'{len(failed)} of {len(rows)} variants did not finish ({", ".join(failed)}); their '
         f'errors are in {os.path.join(directory, runner.STATE_FILE)} and logs/; rerun the same '
         'command to retry them.', 1)


if __name__ == '__main__':
  run_command(main, 'engine.sweep', required=('config', 'workdir'))
