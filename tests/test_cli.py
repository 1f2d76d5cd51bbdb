"""The command line: `python -m engine.main` runs an experiment; bad input stops it early."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_OVERRIDES = ['--config.model.embed_dim=32', '--config.model.mlp_dim=64',
                  '--config.model.num_layers=1', '--config.data.embedded_max_bytes=100000',
                  '--config.train.log_every=1', '--config.train.eval_batches=1']


def _run(*args, devices=1):
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=(
      os.environ['XLA_FLAGS'] + f' --xla_force_host_platform_device_count={devices}'))
  return subprocess.run([sys.executable, '-m', 'engine.main', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_main_runs_an_experiment_with_overrides(tmp_path):
  proc = _run('--config=experiments/tiny.py:steps=3,mesh=2x1x2', f'--workdir={tmp_path}',
              *TINY_OVERRIDES, devices=4)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'step 3/3' in proc.stderr and 'per-device memory' in proc.stderr
  saved = json.load(open(tmp_path / 'config.json'))
  assert saved['model']['embed_dim'] == 32
  assert (saved['mesh']['data'], saved['mesh']['fsdp'], saved['mesh']['tensor']) == (2, 1, 2)
  assert os.listdir(tmp_path / 'checkpoints') == ['3']


@pytest.mark.parametrize('override, message', [
    ('--config.model.num_layerz=3', 'num_layerz'),
    ('--config.mesh.data=3', 'mesh: data*fsdp*tensor = 3*1*1 = 3, but there are 1 devices'),
    ('--config.data.source=file', "data.path='' is not a file"),
    ('--config.optim.b2=1.5', 'optim.b2=1.5 must lie in [0, 1)'),
    ('--config=experiments/no_such_experiment.py', 'No such file or directory'),
])
def test_bad_override_fails_before_anything_runs(override, message, tmp_path):
  config = '--config=experiments/tiny.py'
  if override.startswith('--config='):
    config, override = override, '--debug=false'
  proc = _run(config, f'--workdir={tmp_path}', override)
  assert proc.returncode != 0
  assert message in proc.stderr, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]  # One clear line, not a traceback.
  assert not (tmp_path / 'checkpoints').exists()


def test_a_workdir_that_is_a_file_is_refused_in_one_line(tmp_path):
  not_a_dir = tmp_path / 'notes.txt'
  not_a_dir.write_text('keep me')
  proc = _run('--config=experiments/tiny.py', f'--workdir={not_a_dir}')
  assert proc.returncode == 2
  assert f'error: --workdir={not_a_dir} is a file' in proc.stderr, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr and not_a_dir.read_text() == 'keep me'


def test_show_layout_prints_every_parameter_and_draws_the_layout():
  env = dict(os.environ, JAX_PLATFORMS='cpu')  # conftest's XLA_FLAGS: 8 devices.
  proc = subprocess.run(
      [sys.executable, '-m', 'engine.analysis.show_layout',
       '--config=experiments/tiny.py:mesh=2x2x2', '--param=blocks/w_up_DF'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "blocks/w_up_DF" in out and "P(None, 'fsdp', 'tensor')" in out
  assert 'parameters per device:' in out and 'input batch (16, 65)' in out
  assert all(f'CPU {d}' in out or f',{d}' in out for d in range(8))
