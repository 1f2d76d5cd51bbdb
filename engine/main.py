"""Entry point: `python -m engine.main --config=experiments/x.py[:arg] --workdir=DIR`.

Parses flags and calls engine.train.train; nothing else lives here.
"""

from absl import app, flags
from ml_collections import config_flags

from engine import train
from engine.metrics import quiet_library_logs

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file, optionally with :arg.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints and metrics; rerun '
                               'with the same one to resume.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  train.train(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
