"""Entry point: `python -m engine.main --config=experiments/x.py[:arg] --workdir=DIR`.

Parses flags, starts jax.distributed where there are several processes, and calls
engine.train.loop.train; nothing else lives here (`--print_config` prints the config and stops
before all of it: engine/cli/config_help.py). Bad input (a flag, the experiment file, a config
value) ends the run with one line, `error: ...`, and exit status 2; `run(argv)` does all of it
inside a process, for tests.
"""

import sys
import traceback
from collections.abc import Sequence

import jax
from absl import app, flags
from ml_collections import config_flags

from engine import assemble
from engine.cli import config_help
from engine.distributed import startup as distributed
from engine.train import goodput
from engine.train import loop as train
from engine.errors import CheckpointError, ConfigError, DISK_FULL, is_disk_full
from engine.train.finiteness import NonFiniteError
from engine.cli.command_line import MAIN, fail, innermost, parse_flags
from engine.runtime.library_output import quiet_library_output

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file, optionally with :arg.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints and metrics; rerun '
                               'with the same one to resume.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None, 'host:port of process 0, for multi-process runs (else '
    'JAX_COORDINATOR_ADDRESS, or auto-detection on TPU VMs and SLURM).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, "This process's index.")
_HEARTBEAT = flags.DEFINE_integer(
    'heartbeat_timeout_s', 30, 'A process silent this long is declared dead and the others stop '
    'with an error.')
_DEBUG = flags.DEFINE_bool('debug', False, 'Show the traceback of the errors the engine explains '
                           'in one line (bad config, a step that is not finite).')
_PRINT_CONFIG = flags.DEFINE_bool(
    'print_config', False, 'Print every config key with its value (the experiment and the '
    'overrides applied) and its help, then exit: 0, or 2 with the error line of a value a run '
    'on this machine would refuse; nothing is written or compiled, and --workdir is not needed.')
# --workdir is required unless --print_config: engine.cli checks both on argv.
flags.mark_flags_as_required(['config'])


def _load_config():
  """The experiment's config with the overrides; a file that cannot be read ends the run."""
  try:
    config = _CONFIG.value
    config.to_dict()  # A config file that failed to load raises on first use.
    return config
  except OSError as error:  # The experiment file cannot be read (the usual cases fail earlier).
    if _DEBUG.value:
      raise
    fail(f'--config={flags.FLAGS["config"].config_filename} could not be read '
          f'({innermost(error)}); pass an experiment file, e.g. --config=experiments/tiny.py.')


def _print_config() -> None:
  """--print_config: the config as the run would use it, before anything starts; then the
  check a run makes first (engine.assemble.check, on this machine's devices; it writes and
  compiles nothing), so that a value the run would refuse gets the run's error line."""
  config = _load_config()
  try:
    config_help.check_known_keys(config)
    print(config_help.format_config(config), flush=True)
    assemble.check(config, jax.devices())
  except ConfigError as error:
    if _DEBUG.value:
      raise
    fail(str(error))


def main(argv):
  if len(argv) > 1:
    fail(f'unexpected arguments {argv[1:]}; everything is given as a flag, --name=value (e.g. '
          '--config.train.num_steps=50), and a value holding spaces is quoted.')
  if _PRINT_CONFIG.value:
    return _print_config()
  if _WORKDIR.value is None:  # Given --flagfile, engine.cli left the required flags to this.
    fail(dict(MAIN.missing)[('workdir',)])
  if not _WORKDIR.value.strip():
    fail('--workdir is empty; pass the directory for checkpoints and metrics, e.g. '
          '--workdir=/tmp/run.')
  quiet_library_output(_DEBUG.value)
  try:
    distributed.initialize(distributed.DistributedOptions(
        _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _HEARTBEAT.value))
  except ValueError as error:  # Process flags or JAX_* variables that contradict each other.
    if _DEBUG.value:
      raise
    fail(str(error))
  except distributed.PeerMissingError as error:
    if _DEBUG.value:
      raise
    fail(str(error), 1)
  config = _load_config()
  try:
    train.train(config, _WORKDIR.value, started=_STARTED)
  except (ConfigError, NonFiniteError, CheckpointError) as error:
    if _DEBUG.value:
      raise
    # With several processes, every one stops, naming this one, whatever it was waiting for.
    distributed.fail_run(str(error), 2 if isinstance(error, ConfigError) else 1)
  except OSError as error:  # Writing metrics to a full disk, say.
    if _DEBUG.value:
      raise
    what = DISK_FULL if is_disk_full(error, _WORKDIR.value) else innermost(error)
    distributed.fail_run(f'--workdir={_WORKDIR.value}: {what}; free space there or fix the file '
                         'named, then rerun the same command to resume from the last checkpoint, '
                         'or rerun with another --workdir.', 1)
  except Exception as error:  # A bug: its traceback, then the other processes are stopped too.
    if _DEBUG.value or not distributed.is_active():
      raise
    traceback.print_exc()
    distributed.fail_run(f'{type(error).__name__}: {innermost(error)} (the traceback is above); '
                         'rerun the same command to resume from the last checkpoint.', 1)


def run(argv: Sequence[str]) -> int:
  """`python -m engine.main ARGV` inside this process, for tests: parses the flags afresh (so it
  can be called again and again), runs main, and returns the exit status instead of exiting.
  The command line itself goes through absl's app.run."""
  flags.FLAGS.unparse_flags()
  for name in [name for name in flags.FLAGS if name.startswith('config.')]:
    delattr(flags.FLAGS, name)  # The overrides the previous parse defined.
  sys.modules.pop('config_config', None)  # ml_collections would reuse the last experiment's.
  saved, sys.argv = sys.argv, ['engine.main', *argv]  # ml_collections reads overrides there.
  try:
    main(parse_flags(sys.argv))
    return 0
  except SystemExit as exit_:
    return exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
  finally:
    sys.argv = saved


_STARTED = None  # The command's start, for the goodput (None: when train starts, as in tests).

if __name__ == '__main__':
  _STARTED = goodput.process_started()
  app.run(main, flags_parser=parse_flags)
