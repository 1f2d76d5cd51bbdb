"""Goodput (engine/train/goodput.py) added up over a run's attempts, and the persistent
compilation cache (engine/runtime/compile_cache.py) that spares a restart its compiles."""

import json
import os
import subprocess
import sys

import jax
import pytest

from engine.runtime import compile_cache
from engine.train import goodput
from engine.train.loop import train
from engine.workdir import run_dir
from tests.support.bad_input_checks import ROOT
from tests.support.helpers import tiny_config


def _attempt(started, updated, first, last, steps_s, **badput):
  return {'started': started, 'updated': updated, 'first_step': first, 'last_step': last,
          'steps_s': steps_s, 'badput_s': badput}


def test_attempts_add_up_with_the_lost_steps_and_the_stop_between_them():
  # Attempt 1 runs steps 1-50 and is killed; attempt 2 restarts 30 s later from step 40's
  # checkpoint: its 10 steps 41-50 (1/5 of attempt 1's 80 s of steps) ran twice.
  first = _attempt(0, 100, 0, 50, 80.0, startup=10.0, checkpoints=5.0, data=3.0, evaluation=2.0)
  second = _attempt(130, 200, 40, 60, 50.0, startup=15.0, checkpoints=2.0, data=1.0,
                    evaluation=2.0)
  totals = goodput.account([first, second])
  assert totals['badput_s'] == {'startup': 25.0, 'checkpoints': 7.0, 'data': 4.0,
                                'evaluation': 4.0, 'lost_steps': 16.0, 'stopped': 30.0}
  assert (totals['productive_s'], totals['wall_s'], totals['attempts']) == (114.0, 200, 2)
  assert totals['goodput'] == pytest.approx(0.57)
  # Every second of the wall time is either productive or one cause's badput.
  assert totals['productive_s'] + sum(totals['badput_s'].values()) == totals['wall_s']
  # A restart from nothing (no checkpoint yet) loses every step of the attempt before it.
  again = goodput.account([first, _attempt(100, 180, 0, 50, 80.0, startup=0.0)])
  assert again['badput_s']['lost_steps'] == 80.0 and again['productive_s'] == 80.0
  assert goodput.account([])['goodput'] is None


def test_the_process_start_is_before_now():
  import time  # pylint: disable=g-import-not-at-top
  assert 0 < time.time() - goodput.process_started() < 24 * 3600


def _config(steps=6):
  config = tiny_config(mesh=(8, 1, 1), steps=steps)
  config.train.log_every, config.train.eval_every, config.train.checkpoint_every = 2, 3, 3
  return config


@pytest.mark.slow
def test_a_run_and_its_resume_report_goodput_over_both_attempts(tmp_path):
  workdir = tmp_path / 'run'
  first = train(_config(steps=4), str(workdir))
  summary = first.summary
  assert 0 < summary['goodput'] < 1 and summary['attempts'] == 1
  badput = summary['badput_s']
  assert badput['startup'] > 0 and badput['checkpoints'] > 0 and badput['evaluation'] > 0
  assert badput['lost_steps'] == badput['stopped'] == 0
  records = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  shares = [r['goodput/share'] for r in records if 'goodput/share' in r]
  assert [r['step'] for r in records if 'goodput/share' in r] == [2, 4]
  assert all(0 < share < 1 for share in shares)
  # Extended to 6 steps: a second attempt from step 4's checkpoint (schedule end kept).
  config = _config(steps=6)
  config.optim.decay_steps = 4
  second = train(config, str(workdir)).summary
  attempts = json.loads((workdir / goodput.FILE).read_text())['attempts']
  assert [(a['first_step'], a['last_step']) for a in attempts] == [(0, 4), (4, 6)]
  assert second['attempts'] == 2 and second['badput_s']['stopped'] > 0
  assert second['badput_s']['lost_steps'] == 0  # It resumed from the step the first ended at.
  totals = goodput.account(attempts)
  assert second['goodput'] == pytest.approx(totals['goodput'])
  assert totals['productive_s'] + sum(totals['badput_s'].values()) == pytest.approx(
      totals['wall_s'])


def test_the_cache_directory_by_setting(tmp_path):
  workdir = run_dir.resolve(str(tmp_path / 'run'))
  assert compile_cache.directory('none', workdir) is None
  assert compile_cache.directory(str(tmp_path / 'shared'), workdir) == str(tmp_path / 'shared')
  before = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update('jax_compilation_cache_dir', None)
    assert compile_cache.directory('', workdir) == str(workdir / 'compile_cache')
    jax.config.update('jax_compilation_cache_dir', str(tmp_path / 'jax'))
    assert compile_cache.directory('', workdir) == str(tmp_path / 'jax')  # JAX's own is kept.
  finally:
    jax.config.update('jax_compilation_cache_dir', before)


@pytest.mark.slow
def test_a_second_start_reads_its_programs_from_the_cache(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  config = _config(steps=2)
  config.train.compile_cache_dir = str(tmp_path / 'cache')
  first = train(config, str(tmp_path / 'first')).summary['compilation']
  second = train(config, str(tmp_path / 'second')).summary['compilation']
  assert first['cache_hits'] == 0 and first['programs'] > 0
  assert second['cache_hits'] >= 2  # The train and eval steps at least.
  assert second['seconds'] < first['seconds']
  assert any(name.startswith('jit_train_step') for name in os.listdir(tmp_path / 'cache'))
  assert jax.config.jax_compilation_cache_dir == before  # The suite's own cache is back.


@pytest.mark.slow
def test_two_runs_share_one_cache_at_once(tmp_path):
  """Two runs started together on one cache directory (JAX locks it for every read and write):
  both train, neither reads a damaged entry, and every program is there once. (A second start
  reading them back: the test above.)"""
  cache = tmp_path / 'cache'
  env = dict(os.environ, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')

  def start(name):
    return subprocess.Popen(
        [sys.executable, '-m', 'engine.main', '--config=experiments/tiny.py:steps=2',
         f'--workdir={tmp_path / name}', f'--config.train.compile_cache_dir={cache}',
         '--config.model.num_layers=1'], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)

  runs = [start('a'), start('b')]
  for run in runs:
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    assert 'persistent compilation cache entry' not in err, err[-2000:]  # JAX's read warning.
  entries = [name for name in os.listdir(cache) if name.endswith('-cache')]
  assert any(name.startswith('jit_train_step') for name in entries)
  for run in ('a', 'b'):
    compilation = json.loads((tmp_path / run / 'summary.json').read_text())['compilation']
    assert compilation['programs'] > 0
