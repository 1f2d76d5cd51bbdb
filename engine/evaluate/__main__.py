"""The command line of engine.evaluate: `python -m engine.evaluate --workdir=RUN
[--text_file=FILE]` (the scoring itself: engine/evaluate/scoring.py)."""

from absl import flags

from engine import config as config_lib
from engine.cli.command_line import add_bos_flag, run_command
from engine.evaluate.scoring import check_flags, run_heldout, run_text_file

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run to evaluate.')
_TEXT_FILE = flags.DEFINE_string('text_file', None, 'A UTF-8 text file to score instead of the '
                                 'run\'s held-out split.')
_EVAL_BATCHES = flags.DEFINE_integer('eval_batches', None, 'Held-out batches to score (default: '
                                     'the run\'s train.eval_batches, as the training eval).')
_BATCH = flags.DEFINE_integer('batch', 8, 'Windows per compiled call.')
_MESH = flags.DEFINE_string('mesh', '1x1x1', f'Mesh {config_lib.MESH_FORMAT} (axes not given '
                            'are 1; its devices are the first ones).')
_ADD_BOS = add_bos_flag()


def main(argv):
  del argv
  check_flags(_BATCH.value, _EVAL_BATCHES.value, _TEXT_FILE.value)
  if _TEXT_FILE.value is None:
    print(run_heldout(_WORKDIR.value, _MESH.value, _BATCH.value, _EVAL_BATCHES.value))
  else:
    print(run_text_file(_WORKDIR.value, _MESH.value, _BATCH.value, _TEXT_FILE.value,
                         _ADD_BOS.value))


if __name__ == '__main__':
  run_command(main, 'engine.evaluate', required=('workdir',))
