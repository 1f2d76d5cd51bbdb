"""Entry point: `python -m engine.main --config=experiments/x.py[:arg] --workdir=DIR`.

Parses flags, starts jax.distributed where there are several processes, and calls
engine.train.train; nothing else lives here.
"""

from absl import app, flags
from ml_collections import config_flags

from engine import distributed, train
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
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  distributed.initialize(distributed.DistributedOptions(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _HEARTBEAT.value))
  train.train(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
