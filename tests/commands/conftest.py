"""Fixtures the command tests share."""

import pytest

from engine.train import loop as train
from experiments import tiny

# The command line that trained `finished_run` (rerunning it resumes that run).
FINISHED_RUN_ARGV = ('--config=experiments/tiny.py', '--config.model.name=llama',
                     '--config.train.num_steps=2')


@pytest.fixture(scope='session')
def finished_run(tmp_path_factory):
  """$RUN: two steps of a tiny Llama (experiments/tiny.py with FINISHED_RUN_ARGV's overrides),
  trained once per test process; tests read it and must not change it."""
  config = tiny.get_config()
  config.model.name = 'llama'
  config.train.num_steps = 2
  workdir = tmp_path_factory.mktemp('finished_run')
  train.train(config, str(workdir))
  return workdir
