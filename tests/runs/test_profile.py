"""train.profile_steps: a jax.profiler trace of the chosen steps, and nothing else changed."""

import logging
import pathlib

import pytest

from engine.errors import ConfigError
from engine.config import parse_profile_steps as parse_steps
from engine.train.profiling import StepProfiler
from engine.train.loop import train
from tests.support.helpers import tiny_config


@pytest.mark.slow
def test_a_trace_of_the_chosen_steps_leaves_the_run_unchanged(tmp_path, caplog):
  config = tiny_config(mesh=(8, 1, 1), steps=4)
  plain = train(config, str(tmp_path / 'plain'))
  config.train.profile_steps = '2:3'
  with caplog.at_level(logging.INFO, logger='absl'):  # Earlier tests may quiet absl's.
    profiled = train(config, str(tmp_path / 'profiled'))
  traces = list((tmp_path / 'profiled' / 'profile' / 'plugins' / 'profile').glob('*/*.xplane.pb'))
  assert len(traces) == 1 and traces[0].stat().st_size > 0, traces
  assert not (tmp_path / 'plain' / 'profile').exists()
  logged = [r.getMessage() for r in caplog.records if 'Profiled steps' in r.getMessage()]
  assert logged == [f'Profiled steps 2 to 3 into {tmp_path}/profiled/profile; open it with '
                    f'`tensorboard --logdir={tmp_path}/profiled/profile` (pip install tensorboard '
                    'tensorboard-plugin-profile; the Profile tab).'], logged
  assert profiled.train_losses == plain.train_losses  # Same steps, bit for bit.
  assert sorted(profiled.train_losses) == [1, 2, 3, 4]


@pytest.mark.parametrize('start_step, expected', [
    (0, (5, 7)), (4, (5, 7)), (5, (6, 7)), (6, (7, 7)), (7, (-1, -1)), (9, (-1, -1))])
def test_a_resumed_run_traces_the_steps_of_the_range_it_has_left(start_step, expected):
  profiler = StepProfiler('5:7', 10, start_step, pathlib.Path('/nonexistent'))
  assert (profiler.first, profiler.last) == expected


def test_the_steps_parse_or_say_what_is_wrong():
  assert parse_steps('', 10) is None
  assert parse_steps('3:3', 10) == (3, 3)
  assert parse_steps('1:10', 10) == (1, 10)
  for bad in ('5', '5:', 'a:b', '1:2:3', '0:2', '3:2', '9:11'):
    with pytest.raises(ConfigError, match='train.profile_steps='):
      parse_steps(bad, 10)
