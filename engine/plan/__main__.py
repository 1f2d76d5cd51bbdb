"""The command line of engine.plan: `python -m engine.plan --config=EXPERIMENT
--topology=v5p:4x4x8` (the planning itself: engine/plan/planner.py)."""

import json
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from engine.cli.command_line import check_out_prefix, run_command
from engine import config as config_lib
from engine.errors import ConfigError
from engine.plan import search
from engine.plan.planner import DCN_GB_PER_S, HOST_GB_PER_S, plan
from engine.plan.report import markdown, search_markdown

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=False)
_TOPOLOGY = flags.DEFINE_string('topology', None, 'TPU topology VERSION:SHAPE, e.g. v5p:4x4x8.')
_NUM_SLICES = flags.DEFINE_integer('num_slices', 1, 'Slices joined by the data-centre network '
                                   '(mesh.dcn_data x mesh.dcn_fsdp must equal it when > 1).')
_MODES = flags.DEFINE_list('modes', ['auto', 'manual'], 'Modes to compile.')
_MESHES = flags.DEFINE_list('meshes', [], 'Candidate meshes DATAxFSDPxTENSOR[xCONTEXT[xSTAGE'
                            '[xEXPERT]]]; default: the config\'s own.')
_DCN_GB_PER_S = flags.DEFINE_float(
    'dcn_gb_per_s', None, 'Bandwidth between slices, GB/s (gigabytes) per chip; default: the '
    f'chip\'s published figure (engine/chips.py), else {DCN_GB_PER_S:g}.')
_HOST_GB_PER_S = flags.DEFINE_float(
    'host_gb_per_s', None, 'Bandwidth to host memory, GB/s per chip, both directions together '
    '(offloaded state and activations); default: the chip\'s published figure, else '
    f'{HOST_GB_PER_S:g}.')
_OUT = flags.DEFINE_string('out', None, 'Write OUT.md and OUT.json.')
_SEARCH = flags.DEFINE_bool(
    'search', False, 'Search the meshes, remat policies, micro-batch counts and memory levers '
    '(engine/plan/search.py) instead of --meshes: estimate every candidate, compile the --top '
    'fastest that fit; with --num_slices, also how the data and fsdp axes split between the '
    'slices. With --out, an interrupted search resumes from OUT.json.')
_FIXED = flags.DEFINE_list('fixed', [], 'With --search: mesh axes held at a size, AXIS=SIZE '
                           '(e.g. tensor=1,stage=1).')
_TOP = flags.DEFINE_integer('top', 4, 'With --search: how many candidates to compile.')
_MEMORY_BREAKDOWN = flags.DEFINE_bool(
    'memory_breakdown', False, 'Also list, per candidate, the largest buffers of the step\'s '
    'memory at its peak (the compiler\'s memory layout; for a candidate that does not fit too).')


def main(argv):
  del argv
  check_out_prefix(_OUT.value)
  start = time.perf_counter()
  if _SEARCH.value:
    result = search.search(_CONFIG.value, _TOPOLOGY.value, _MODES.value, _fixed_axes(),
                           _TOP.value, _OUT.value, _DCN_GB_PER_S.value, _NUM_SLICES.value,
                           _HOST_GB_PER_S.value)
  else:
    result = plan(_CONFIG.value, _TOPOLOGY.value, _NUM_SLICES.value, _MODES.value, _MESHES.value,
                  _DCN_GB_PER_S.value, _MEMORY_BREAKDOWN.value, _HOST_GB_PER_S.value)
  result['wall_s'] = time.perf_counter() - start
  config_arg = next((a.split('=', 1)[1] for a in sys.argv if a.startswith('--config=')),
                    flags.FLAGS['config'].value)
  overrides = [a for a in sys.argv[1:] if a.startswith('--config.')]
  result['plan_command'] = ' '.join(['python -m engine.plan', *sys.argv[1:]])
  report = (search_markdown if _SEARCH.value else markdown)(result, config_arg, overrides)
  report += f'\nPlanned in {result["wall_s"]:.0f} s.\n'
  print(report)
  if _OUT.value:
    with open(_OUT.value + '.md', 'w') as f:
      f.write(report)
    with open(_OUT.value + '.json', 'w') as f:
      json.dump(result, f, indent=1, default=str)
    logging.info('Wrote %s.md and %s.json', _OUT.value, _OUT.value)


def _fixed_axes() -> dict[str, int]:
  """--fixed as {axis: size}, checked before anything compiles."""
  if _MESHES.value:
    raise ConfigError('--search finds the meshes itself: drop --meshes, or drop --search.')
  if _TOP.value < 1:
    raise ConfigError(f'--top={_TOP.value} must be at least 1: the candidates to compile.')
  fixed = {}
  for item in _FIXED.value:
    axis, _, size = item.partition('=')
    if axis not in config_lib.MESH_AXES or not size.isdigit() or int(size) < 1:
      raise ConfigError(f'--fixed={item!r} must be AXIS=SIZE, AXIS one of '
                        f'{", ".join(config_lib.MESH_AXES)} and SIZE a positive integer, e.g. '
                        '--fixed=tensor=1,stage=1.')
    fixed[axis] = int(size)
  return fixed


if __name__ == '__main__':
  run_command(main, 'engine.plan', required=('config', 'topology'))
