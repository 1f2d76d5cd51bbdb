"""Entry point: `python -m engine.main --config=experiments/x.py[:arg] --workdir=DIR`.

Parses flags, starts jax.distributed where there are several processes, and calls
engine.train.train; nothing else lives here.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from engine import distributed, train
from engine.config import ConfigError
from engine.metrics import quiet_library_logs

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
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  distributed.initialize(distributed.DistributedOptions(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _HEARTBEAT.value))
  try:
    config = _CONFIG.value
    config.to_dict()  # A config file that failed to load raises on first use.
  except OSError as error:  # The experiment file is missing or fails to load.
    if _DEBUG.value:
      raise
    print(f'error: --config could not be read: {error.__cause__ or error}', file=sys.stderr)
    sys.exit(2)
  try:
    train.train(config, _WORKDIR.value)
  except (ConfigError, train.NonFiniteError) as error:
    if _DEBUG.value:
      raise
    # The message names the problem and the fix; a traceback would only bury it.
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2 if isinstance(error, ConfigError) else 1)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad --config (a missing file, an unknown or mistyped override
  key) reported in one line instead of the traceback of the config library."""
  try:
    return flags.FLAGS(argv)
  except flags.Error:
    raise  # absl prints these with the usage.
  except Exception as error:  # pylint: disable=broad-except
    if any(arg in ('--debug', '--debug=true', '--debug=True') for arg in argv):
      raise
    detail = error
    while isinstance(detail, BaseException) and len(detail.args) == 1:
      detail = detail.args[0]  # ml_collections wraps a KeyError in an AttributeError.
    print(f'error: --config could not be read: {detail}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
