"""The command line of engine.lm_eval: a finished run on lm-eval tasks.

  python -m engine.lm_eval --workdir=/tmp/sft --tasks=arc_easy,hellaswag [--num_fewshot=0] \
      [--limit=100] [--include_path=MY_TASKS] [--mesh=1x1x1] [--batch=8] [--out=/tmp/sft_eval]

The run is lm-eval's model (engine/lm_eval/harness.py); the harness chooses the tasks' documents,
prompts and metrics. --include_path adds task YAML files of your own (a task on local files:
`dataset_path: json` with `dataset_kwargs: {data_files: ...}`). Prints lm-eval's table; --out
writes OUT.json (the results, the versions, the configs of the tasks). Needs the `lm_eval` extra
(pip install -e ".[lm_eval]"); an unknown task is refused before the run is loaded.
"""

import importlib.util
import json
import os

from absl import flags

from engine.cli.command_line import check_out_prefix, run_command
from engine.errors import ConfigError

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run to evaluate.')
_TASKS = flags.DEFINE_list('tasks', None, 'lm-eval task (or group) names, comma-separated.')
_INCLUDE = flags.DEFINE_string('include_path', None, 'A directory of task YAML files of your own.')
_FEWSHOT = flags.DEFINE_integer('num_fewshot', None, 'Examples in each prompt (default: the '
                                "task's).")
_LIMIT = flags.DEFINE_integer('limit', None, 'At most this many documents per task.')
_MESH = flags.DEFINE_string('mesh', '1x1x1', 'Mesh DATAxFSDPxTENSOR[...] to score on (its '
                            'devices are the first ones).')
_BATCH = flags.DEFINE_integer('batch', 8, 'Requests per compiled call.')
_OUT = flags.DEFINE_string('out', None, 'Write OUT.json.')


def main(argv):
  del argv
  if importlib.util.find_spec('lm_eval') is None:
    raise ConfigError('engine.lm_eval needs the lm_eval package, which is not installed; pip '
                      'install -e ".[lm_eval]" (or pip install lm_eval).')
  if _BATCH.value < 1 or (_LIMIT.value is not None and _LIMIT.value < 1):
    raise ConfigError(f'--batch={_BATCH.value} and --limit={_LIMIT.value} must be >= 1.')
  if _OUT.value:
    check_out_prefix(_OUT.value)
  import lm_eval  # pylint: disable=g-import-not-at-top
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if _INCLUDE.value and not os.path.isdir(_INCLUDE.value):
    raise ConfigError(f'--include_path={_INCLUDE.value!r} is not a directory; pass the '
                      'directory holding your task YAML files.')
  manager = TaskManager(include_path=_INCLUDE.value)
  unknown = [t for t in _TASKS.value if t not in manager.all_tasks]
  if unknown:
    raise ConfigError(f'--tasks: {unknown[0]!r} is no lm-eval task or group (lm-eval '
                      f'{lm_eval.__version__} knows {len(manager.all_tasks)}); check the name, '
                      'or pass --include_path=the directory of its YAML file.')
  from engine.lm_eval.harness import EngineLM  # pylint: disable=g-import-not-at-top
  results = lm_eval.simple_evaluate(
      model=EngineLM(_WORKDIR.value, _MESH.value, _BATCH.value), tasks=_TASKS.value,
      task_manager=manager, num_fewshot=_FEWSHOT.value, limit=_LIMIT.value)
  print(lm_eval.utils.make_table(results))
  if _OUT.value:
    with open(_OUT.value + '.json', 'w') as f:
      json.dump({k: results[k] for k in ('results', 'versions', 'configs', 'n-shot')
                 if k in results}, f, indent=1, default=str)


if __name__ == '__main__':
  run_command(main, 'engine.lm_eval', required=('workdir', 'tasks'))
