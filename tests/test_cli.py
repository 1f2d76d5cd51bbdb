"""The command line: `python -m engine.main` runs an experiment (bad input: test_bad_inputs.py)."""

import json
import os
import subprocess
import sys

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


def test_show_layout_prints_every_parameter_and_draws_the_layout():
  env = dict(os.environ, JAX_PLATFORMS='cpu')  # conftest's XLA_FLAGS: 8 devices.
  proc = subprocess.run(
      [sys.executable, '-m', 'engine.analysis.show_layout',
       '--config=experiments/tiny.py:mesh=2x2x2', '--param=blocks/w_up_DF'], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "blocks/w_up_DF" in out and "P(None, 'fsdp', 'tensor')" in out
  assert 'parameters per device:' in out and 'input batch (16, 65)' in out
  assert all(f'CPU {d}' in out or f',{d}' in out for d in range(8))
