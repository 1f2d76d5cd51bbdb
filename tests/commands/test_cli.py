"""The command line: `python -m engine.main` runs an experiment (bad input: test_bad_inputs.py)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from engine.cli.argv import bool_flag, config_overrides, flag_args, flag_value
from engine.config import MESH_AXES, format_mesh, parse_mesh
from tests.unit.test_platforms import TPU_NOISE, require_cpu_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_OVERRIDES = ['--config.model.embed_dim=32', '--config.model.mlp_dim=64',
                  '--config.model.num_layers=1', '--config.data.embedded_max_bytes=100000',
                  '--config.train.log_every=1', '--config.train.eval_batches=1']


def _run(*args, devices=1):
  # As a user runs it: no JAX_PLATFORMS (conftest sets it for this process), so the engine
  # chooses the platform itself (engine/runtime/platforms.py).
  env = dict(os.environ, XLA_FLAGS=(
      os.environ['XLA_FLAGS'] + f' --xla_force_host_platform_device_count={devices}'))
  env.pop('JAX_PLATFORMS', None)
  return subprocess.run([sys.executable, '-m', 'engine.main', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_main_runs_an_experiment_with_overrides(tmp_path):
  """...and, on this CPU machine with the tpu extra installed, without a word from libtpu."""
  require_cpu_only()
  proc = _run('--config=experiments/tiny.py:steps=3,mesh=2x1x2', f'--workdir={tmp_path}',
              *TINY_OVERRIDES, devices=4)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'step 3/3' in proc.stderr and 'per-device memory' in proc.stderr
  noise = [line for line in proc.stderr.splitlines() if any(s in line for s in TPU_NOISE)]
  assert not noise, noise
  saved = json.load(open(tmp_path / 'config.json'))
  assert saved['model']['embed_dim'] == 32
  assert (saved['mesh']['data'], saved['mesh']['fsdp'], saved['mesh']['tensor']) == (2, 1, 2)
  assert os.listdir(tmp_path / 'checkpoints') == ['3']


def _pictures(out: str) -> dict[str, list[list[set[int]]]]:
  """Each box picture of visualize_sharding in `out`, under the line that names it (its text up
  to the first ' ('), as a grid: picture row -> picture column -> the device ids in that cell."""
  pictures, lines = {}, out.splitlines()
  for i, line in enumerate(lines):
    if not line.startswith('┌'):
      continue
    title = lines[i - 1].split(' (')[0]
    grid, band = [], []
    for row in lines[i + 1:]:
      if row[:1] in '├└':  # The end of one row of cells.
        cells = [' '.join(c.strip() for c in column) for column in zip(*band)]
        ids = [re.fullmatch(r'CPU ([\d,]+)', ' '.join(c.split())) for c in cells]
        assert all(ids), (title, cells)
        grid.append([{int(d) for d in m.group(1).split(',')} for m in ids])
        band = []
        if row.startswith('└'):
          break
      else:
        assert row.startswith('│'), row
        band.append(row.strip('│').split('│'))
    pictures[title] = grid
  return pictures


def test_show_layout_prints_every_parameter_and_draws_the_layout():
  env = dict(os.environ, JAX_PLATFORMS='cpu')  # conftest's XLA_FLAGS: 8 devices.
  env.pop('FORCE_COLOR', None)  # rich draws boxes (parsed below) only without colour.
  proc = subprocess.run(
      [sys.executable, '-m', 'engine.analysis.show_layout',
       '--config=experiments/tiny.py:mesh=2x2x2', '--param=blocks/w_up_DF'], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "blocks/w_up_DF" in out and "P(None, 'fsdp', 'tensor')" in out
  assert 'parameters per device:' in out and 'input batch (16, 65)' in out
  # Where each block should be, from the mesh's own device array (the engine's mesh is
  # jax.make_mesh over ('data', 'fsdp', 'tensor', 'context', 'stage', 'expert')), not from the
  # printer. ids: [data, fsdp, tensor].
  ids = np.vectorize(lambda d: d.id)(
      jax.make_mesh((2, 2, 2, 1, 1, 1), MESH_AXES).devices)[:, :, :, 0, 0, 0]
  # w_up_DF [layers, D, F] under P(None, 'fsdp', 'tensor'): the picture shows (D, F); picture
  # row f, column t is block (f, t), held by the devices at fsdp f, tensor t: one per data index
  # (replicated over `data`), drawn together in one cell, e.g. 'CPU 0,4'.
  weight = [[set(ids[:, f, t].tolist()) for t in range(2)] for f in range(2)]
  # The batch [B, L + 1] under P(('data', 'fsdp'), None): 4 row blocks, data-major (row
  # 2 d + f), each held by the devices at data d, fsdp f over both tensor indices; one column.
  batch = [[set(ids[d, f, :].tolist())] for d in range(2) for f in range(2)]
  assert weight == [[{0, 4}, {1, 5}], [{2, 6}, {3, 7}]]  # The CPU mesh: devices in id order.
  assert batch == [[{0, 1}], [{2, 3}], [{4, 5}], [{6, 7}]]
  pictures = _pictures(out)
  assert pictures == {'blocks/w_up_DF': weight, 'input batch': batch}, out


def _train_tokenizer(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, '-m', 'engine.data.train_tokenizer', '--input=README.md',
       '--vocab_size=300', f'--out={tmp_path / "bpe.json"}', '--overwrite', *flags], cwd=ROOT,
      capture_output=True, text=True, timeout=120)


def test_a_commands_log_lines_are_short_unless_verbosity_asks_for_absls(tmp_path):
  """Every log line of a command is `L HH:MM:SS message` (engine/runtime/log_format.py); under
  --verbosity=1, absl's full format (date, microseconds, thread, file:line)."""
  proc = _train_tokenizer(tmp_path)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stderr.splitlines()
  assert any(re.fullmatch(r'I \d\d:\d\d:\d\d Trained on 1 documents \(.*', line)
             for line in lines), lines
  assert all(re.match(r'[IWEF] \d\d:\d\d:\d\d \S', line) for line in lines), lines
  verbose = _train_tokenizer(tmp_path, '--verbosity=1')
  assert verbose.returncode == 0, verbose.stderr
  assert re.search(r'^I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ train_tokenizer\.py:\d+\] Trained on 1 '
                   'documents', verbose.stderr, re.M), verbose.stderr


def test_argv_is_read_as_absl_reads_it():
  """engine/cli/argv.py, which the checks before absl, the sweep and the launchers share."""
  argv = ['prog', '-config=a.py', '--workdir', '/tmp/w', '--config=b.py:x', '--debug',
          '--nodebug', '--', '--config=c.py']
  assert flag_args(argv)[-1] == '--nodebug'  # Nothing after a lone '--'.
  assert flag_value(argv, 'config') == 'b.py:x' and flag_value(argv, 'workdir') == '/tmp/w'
  assert flag_value(argv, 'out') is None and flag_value(['prog', '--out'], 'out') == ''
  assert not bool_flag(argv, 'debug') and bool_flag(['prog', '-debug=True'], 'debug')
  assert config_overrides(['prog', '--config=x.py', '--config.seed', '3', '--noconfig.a.b',
                           '--config.c=1', '--', '--config.d=2']) == [
                               '--config.seed=3', '--noconfig.a.b', '--config.c=1']


def test_format_mesh_writes_what_parse_mesh_reads():
  for text in ('2x2x2', '-1x1x2', '2x1x1x1x2', '1x1x1x1x1x4'):
    assert format_mesh(parse_mesh(text)) == text
  assert format_mesh({'data': 2, 'tensor': 4}, all_axes=True) == '2x1x4x1x1x1'
