"""Every command reads a mesh, a mode and a config key the same way: one parser, one check, one
line (`error: ...`, exit status 2, no traceback) for the same mistake, whichever command makes
it. And the mesh strings mean the same everywhere: axes not given are 1."""

import json
import os

import pytest

from engine import config as config_lib
from engine.assemble import assemble_finished_run
from engine.errors import ConfigError
from tests.support.processes import forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = '--config=experiments/tiny.py'
PLAN = ['engine.plan', '--topology=v5p:2x2x1']


def _commands(workdir: str) -> dict[str, dict[str, list[str]]]:
  """kind of mistake -> command -> its argv (module first)."""
  run = f'--workdir={workdir}'
  return {
      'mesh': {
          'main': ['engine.main', f'{TINY}:mesh=2x', run],
          'bench': ['engine.bench', TINY, '--meshes=2x'],
          'plan': [*PLAN, TINY, '--meshes=2x'],
          'bubble': ['engine.analysis.bubble', f'{TINY}:mesh=2x'],
          'compare': ['engine.analysis.compare', f'{TINY}:mesh=2x', run],
          'show_layout': ['engine.analysis.show_layout', f'{TINY}:mesh=2x'],
          'generate': ['engine.generate', run, '--prompt=a', '--mesh=2x'],
          'evaluate': ['engine.evaluate', run, '--text_file=README.md', '--mesh=2x'],
      },
      'mode': {
          'main': ['engine.main', TINY, run, '--config.parallelism.mode=bogus'],
          'bench': ['engine.bench', TINY, '--modes=bogus'],
          'plan': [*PLAN, TINY, '--modes=bogus'],
          'bubble': ['engine.analysis.bubble', TINY, '--modes=bogus'],
          'compare': ['engine.analysis.compare', TINY, run, '--modes=bogus'],
          'show_layout': ['engine.analysis.show_layout', TINY, '--config.parallelism.mode=bogus'],
      },
      'key': {
          name: [*argv[:argv.index(TINY) + 1], '--config.model.bogus=1']
          for name, argv in {
              'main': ['engine.main', run, TINY], 'bench': ['engine.bench', TINY],
              'plan': [*PLAN, TINY], 'bubble': ['engine.analysis.bubble', TINY],
              'compare': ['engine.analysis.compare', run, TINY],
              'show_layout': ['engine.analysis.show_layout', TINY]}.items()},
  }


def _expected_endings() -> dict[str, str]:
  """What every command's line ends with, after the flag or key that carried the mistake."""
  with pytest.raises(ConfigError) as mesh:
    config_lib.parse_mesh('2x', 'WHERE')
  return {
      'mesh': str(mesh.value).removeprefix('WHERE'),  # '=2x: a mesh is DATAx...'
      'mode': "='bogus' is unknown; choose one of ['auto', 'manual'].",
      'key': ('--config.model.bogus=1: the config has no key model.bogus; the keys and their '
              'defaults are in engine/config.py, default_config().'),
  }


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
  """Every (kind, command) run as the real command (forked from one process that imported the
  engine: tests/support/processes.py)."""
  workdir = tmp_path_factory.mktemp('run')
  # A finished run's record is all generate / evaluate read before the mesh.
  (workdir / 'config.json').write_text(config_lib.default_config().to_json())
  jobs = [(kind, name, argv) for kind, commands in _commands(str(workdir)).items()
          for name, argv in commands.items()]
  results = forked([{'program': argv[0], 'argv': argv[1:], 'cwd': ROOT} for _, _, argv in jobs])
  return {(kind, name): (result['code'], result['output']) for (kind, name, _), result in
          zip(jobs, results)}


def test_each_command_gives_the_same_line_for_the_same_mistake(outcomes):
  endings = _expected_endings()
  for (kind, name), (code, output) in outcomes.items():
    lines = output.strip().splitlines()  # Its stdout and stderr: the one line, nothing else.
    where = f'{name}, bad {kind}: {output[-2000:]}'
    assert code == 2, where
    assert 'Traceback' not in output and len(lines) == 1, where
    assert lines[0].startswith('error: ') and lines[0].endswith(endings[kind]), where
  assert {kind for kind, _ in outcomes} == set(endings)
  assert len({name for _, name in outcomes}) == 8  # Every command that takes any of them.


def test_mesh_strings_fill_unnamed_axes_with_one():
  config = config_lib.default_config()
  config_lib.set_mesh_shape(config, '1x1x1x1x8')
  assert config.mesh.stage == 8
  config_lib.set_mesh_shape(config, '8x1x1')  # engine.bench --meshes=1x1x1x1x8,8x1x1
  assert [config.mesh[a] for a in config_lib.MESH_AXES] == [8, 1, 1, 1, 1, 1]
  assert config_lib.parse_mesh('-1x2x1x2') == {'data': -1, 'fsdp': 2, 'tensor': 1, 'context': 2,
                                               'stage': 1, 'expert': 1}
  config_lib.set_mesh_shape(config, '2x1x1x1x1x4')
  assert [config.mesh[a] for a in config_lib.MESH_AXES] == [2, 1, 1, 1, 1, 4]
  for bad in ('2x', '2x2', '1x1x1x1x1x1x1', 'axbxc', '2x2x2 ', ''):
    with pytest.raises(ConfigError, match='a mesh is DATAxFSDPxTENSOR'):
      config_lib.parse_mesh(bad)


@pytest.mark.slow
def test_a_finished_run_is_laid_out_on_the_devices_its_mesh_names(tmp_path):
  """generate / evaluate / export: --mesh takes the first devices it needs (-1: all of them),
  and a pipelined run's stage axis is not carried onto the generation mesh."""
  config = config_lib.default_config()
  config.mesh.stage, config.train.microbatches = 2, 2
  config.train.pipeline_repeats = 1
  (tmp_path / 'config.json').write_text(config.to_json())
  for mesh, size in (('1x1x1', 1), ('-1x1x1', 8), ('2x1x2', 4), ('1x1x1x1x2', 2)):
    run = assemble_finished_run(str(tmp_path), mesh)
    assert run.setup.mesh.size == size, mesh
    assert dict(run.setup.mesh.shape)['stage'] == (2 if mesh == '1x1x1x1x2' else 1), mesh
    assert json.loads(run.config.to_json())['mesh']['dcn_data'] == 1
  with pytest.raises(ConfigError, match='there are 8 devices'):
    assemble_finished_run(str(tmp_path), '4x4x1')
