"""Learning-rate schedules against NumPy, and extending a finished run without changing them."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.workdir import run_dir as workdir_lib
from engine.config import default_config
from engine.errors import ConfigError
from engine.optimizer import learning_rate_schedule, make_optimizer
from engine.train.loop import train
from tests.support.helpers import tiny_config

PEAK, END = 1e-3, 1e-4


def _reference(schedule, t, warmup, total, fraction=0.2):
  """The learning rate at optimizer step t (0-based), written out from the docs' definitions."""
  if t < warmup:
    return PEAK * t / warmup
  if schedule == 'constant':
    return PEAK
  if schedule == 'cosine':
    progress = min((t - warmup) / (total - warmup), 1.0)
    return END + (PEAK - END) * 0.5 * (1 + math.cos(math.pi * progress))
  decay_start = max(warmup, total - max(1, round(fraction * total)))  # wsd
  if t < decay_start:
    return PEAK
  return PEAK + (END - PEAK) * min((t - decay_start) / (total - decay_start), 1.0)


def _optim(schedule, warmup, decay_steps=-1, fraction=0.2):
  optim = default_config().optim
  optim.learning_rate, optim.end_learning_rate = PEAK, END
  optim.schedule, optim.warmup_steps = schedule, warmup
  optim.decay_steps, optim.decay_fraction = decay_steps, fraction
  return optim


@pytest.mark.parametrize('schedule', ['cosine', 'constant', 'wsd'])
@pytest.mark.parametrize('warmup, num_steps, decay_steps, fraction',
                         [(10, 100, -1, 0.2), (0, 50, -1, 0.3), (5, 200, 60, 1.0)])
def test_each_schedule_matches_its_numpy_reference(schedule, warmup, num_steps, decay_steps,
                                                   fraction):
  if schedule == 'constant' and decay_steps != -1:
    decay_steps = -1  # Refused by validation: constant has no end.
  total = decay_steps if decay_steps > 0 else num_steps
  fn = learning_rate_schedule(_optim(schedule, warmup, decay_steps, fraction), num_steps)
  steps = sorted({0, 1, warmup // 2, warmup, warmup + 1, total // 2, int(total * 0.7),
                  int(total * 0.85), total - 1, total, total + 7, num_steps + 30})
  got = np.array([float(fn(t)) for t in steps])
  want = np.array([_reference(schedule, t, warmup, total, fraction) for t in steps])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_wsd_by_hand():
  # warmup 10 of 100 steps, decay over the last 20: the peak from 10 to 80, halfway down at 90.
  fn = learning_rate_schedule(_optim('wsd', 10), 100)
  assert float(fn(5)) == pytest.approx(5e-4)
  assert float(fn(10)) == pytest.approx(PEAK) and float(fn(80)) == pytest.approx(PEAK)
  assert float(fn(90)) == pytest.approx((PEAK + END) / 2)
  assert float(fn(100)) == pytest.approx(END) and float(fn(500)) == pytest.approx(END)


def test_every_schedule_gives_the_same_optimizer_state_structure():
  params = {'w': jnp.zeros((3, 4)), 'b': jnp.zeros((4,))}
  structures = {jax.tree.structure(jax.eval_shape(make_optimizer(_optim(s, 2), 10).tx.init,
                                                  params)) for s in ('cosine', 'constant', 'wsd')}
  assert len(structures) == 1


def _saved(tmp_path, num_steps, decay_steps=-1, schedule='cosine', warmup=0):
  config = tiny_config(steps=num_steps)
  config.optim.warmup_steps = warmup
  config.optim.decay_steps, config.optim.schedule = decay_steps, schedule
  workdir_lib.write_config(config, tmp_path)
  return tmp_path


@pytest.mark.parametrize('saved, new, refused', [
    ((600, -1, 'cosine'), (600, -1, 'cosine'), False),  # Interrupted, resumed as it was.
    ((600, -1, 'cosine'), (800, -1, 'cosine'), True),  # Extended: the cosine would stretch.
    ((600, -1, 'cosine'), (800, -1, 'wsd'), True),
    ((600, -1, 'cosine'), (800, 600, 'cosine'), False),  # The old end pinned.
    ((600, -1, 'cosine'), (800, 700, 'wsd'), False),  # A new end, given on purpose.
    ((600, -1, 'cosine'), (800, -1, 'constant'), False),
    ((600, 600, 'cosine'), (800, 600, 'cosine'), False),
    ((800, 600, 'cosine'), (800, -1, 'cosine'), True),  # The pinned end forgotten.
    ((600, -1, 'constant'), (800, -1, 'cosine'), False),  # The schedule changed on purpose.
])
def test_check_resumable_refuses_only_a_moved_schedule_end(tmp_path, saved, new, refused):
  workdir = _saved(tmp_path, *saved)
  config = tiny_config(steps=new[0])
  config.optim.decay_steps, config.optim.schedule = new[1], new[2]
  if not refused:
    workdir_lib.check_resumable(config, workdir)
    return
  with pytest.raises(ConfigError) as error:
    workdir_lib.check_resumable(config, workdir)
  end = saved[1] if saved[1] > 0 else saved[0]
  assert f'ends at step {end}, and train.num_steps={new[0]}' in str(error.value)
  assert f'--config.optim.decay_steps={end}' in str(error.value)
  assert '\n' not in str(error.value)


def test_runs_shorter_than_their_warmup_share_one_schedule(tmp_path):
  # Warmup 20: a 10-step run's cosine ends at step 21, as does a 15-step run's; a 100-step run's
  # would not, and the fix offered is that end, a valid decay_steps.
  workdir = _saved(tmp_path, 10, warmup=20)
  config = tiny_config(steps=15)
  config.optim.warmup_steps = 20
  workdir_lib.check_resumable(config, workdir)
  config.train.num_steps = 100
  with pytest.raises(ConfigError, match=r'ends at step 21, .* --config.optim.decay_steps=21 '):
    workdir_lib.check_resumable(config, workdir)


def test_check_resumable_refuses_another_optimizer(tmp_path):
  workdir = _saved(tmp_path, 600, -1, 'cosine')
  config = tiny_config(steps=600)
  config.optim.name = 'muon'
  with pytest.raises(ConfigError, match=r"optim.name='adamw' state; resume with "
                     r'--config.optim.name=adamw, .* --config.train.init_from='):
    workdir_lib.check_resumable(config, workdir)


def _lrs(workdir):
  with open(workdir / 'metrics.jsonl') as f:
    lines = [json.loads(line) for line in f]
  return {l['step']: l['train/learning_rate'] for l in lines if 'train/learning_rate' in l}


@pytest.mark.slow
def test_extending_a_finished_run(tmp_path):
  config = tiny_config(mesh=(8, 1, 1), steps=4)
  config.optim.end_learning_rate = 1e-4
  train(config, str(tmp_path))
  before = {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob('*')}
  longer = tiny_config(mesh=(8, 1, 1), steps=6)
  longer.optim.end_learning_rate = 1e-4
  with pytest.raises(ConfigError, match='ends at step 4, and train.num_steps=6'):
    train(longer, str(tmp_path))
  assert {p.relative_to(tmp_path): p.stat().st_mtime_ns for p in tmp_path.rglob('*')} == before
  # The old end pinned: steps 5 and 6 (optimizer steps 4 and 5) stay at the end value.
  longer.optim.decay_steps = 4
  result = train(longer, str(tmp_path))
  assert sorted(result.train_losses) == [5, 6]
  lrs = _lrs(tmp_path)
  peak = config.optim.learning_rate
  want = [1e-4 + (peak - 1e-4) * 0.5 * (1 + math.cos(math.pi * t / 4)) for t in range(4)]
  np.testing.assert_allclose([lrs[s] for s in range(1, 7)], want + [1e-4, 1e-4], rtol=1e-5)
  assert json.loads((tmp_path / 'config.json').read_text())['optim']['decay_steps'] == 4
