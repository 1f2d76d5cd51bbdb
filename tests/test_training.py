"""End-to-end training: the loss falls on real text; a resumed run continues exactly."""

import json
import os

import jax
import numpy as np
import pytest

from engine import data
from engine.analysis.reference import ReferenceRun
from engine.checkpoint import Checkpointer
from engine.train import setup, train
from tests.helpers import single_device_run, tiny_config, train_batches


def test_loss_falls_on_real_text(tmp_path):
  config = tiny_config(mesh=(4, 1, 2), steps=60, source='embedded')
  config.data.embedded_max_bytes = 300_000
  config.train.log_every = 10
  config.train.eval_every = 30
  result = train(config, str(tmp_path))
  # Byte-level: a uniform guess costs ln(256) = 5.55 nats. 60 steps of a tiny model reach < 3.5.
  assert result.train_losses[10] > result.train_losses[60]
  assert result.eval_losses[60] < 3.5, result.eval_losses
  assert result.eval_losses[60] < result.eval_losses[30]
  # The metrics landed as JSON lines and TensorBoard events.
  lines = [json.loads(l) for l in open(os.path.join(tmp_path, 'metrics.jsonl'))]
  assert {l['step'] for l in lines if 'train/loss' in l} == {10, 20, 30, 40, 50, 60}
  assert any('eval/loss' in l for l in lines)
  assert os.listdir(os.path.join(tmp_path, 'tensorboard'))


def _resumable_config(mesh, steps):
  config = tiny_config(mesh=mesh, steps=steps)
  config.optim.decay_steps = 8  # The schedule must not depend on where the run stops.
  config.train.checkpoint_every = 2
  return config


def test_resume_continues_like_an_uninterrupted_run(tmp_path):
  full = train(_resumable_config((2, 2, 2), 8), str(tmp_path / 'full'))
  # Stop after 5 steps (last checkpoint at 4 plus a final one at 5), rerun to 8.
  first = train(_resumable_config((2, 2, 2), 5), str(tmp_path / 'split'))
  second = train(_resumable_config((2, 2, 2), 8), str(tmp_path / 'split'))
  assert sorted(second.train_losses) == [6, 7, 8]
  split = {**first.train_losses, **second.train_losses}
  for step in range(1, 9):
    np.testing.assert_allclose(split[step], full.train_losses[step], rtol=0, atol=1e-6)


@pytest.fixture(scope='module')
def uninterrupted_6_steps(tmp_path_factory):
  return train(_resumable_config((2, 2, 2), 6), str(tmp_path_factory.mktemp('full')))


@pytest.mark.parametrize('first, second', [('auto', 'manual'), ('manual', 'auto')])
def test_resume_in_the_other_mode_on_another_mesh(first, second, uninterrupted_6_steps, tmp_path):
  full = uninterrupted_6_steps
  config = _resumable_config((2, 2, 2), 4)
  config.parallelism.mode = first
  train(config, str(tmp_path / 'split'))
  config = _resumable_config((4, 1, 2), 6)
  config.parallelism.mode = second
  resumed = train(config, str(tmp_path / 'split'))
  assert sorted(resumed.train_losses) == [5, 6]
  for step in (5, 6):
    np.testing.assert_allclose(resumed.train_losses[step], full.train_losses[step], atol=2e-5)


def test_resume_refuses_a_different_model(tmp_path):
  train(_resumable_config((8, 1, 1), 2), str(tmp_path))
  config = _resumable_config((8, 1, 1), 4)
  config.model.num_layers = 3
  with pytest.raises(ValueError, match='different model config'):
    train(config, str(tmp_path))


def test_a_run_that_fails_early_leaves_the_workdir_usable(tmp_path):
  config = _resumable_config((8, 1, 1), 2)
  config.model.vocab_size = 128  # Smaller than the byte tokenizer's 256: refused at setup.
  with pytest.raises(ValueError, match='model.vocab_size=128'):
    train(config, str(tmp_path))
  assert not (tmp_path / 'config.json').exists()
  result = train(_resumable_config((8, 1, 1), 2), str(tmp_path))  # The fixed command runs.
  assert result.final_step == 2


def test_init_from_starts_from_another_runs_parameters(tmp_path):
  source = str(tmp_path / 'source')
  train(_resumable_config((2, 2, 2), 3), source)
  config = _resumable_config((4, 1, 2), 1)  # Another mesh and mode, a fresh optimizer.
  config.parallelism.mode = 'manual'
  config.train.init_from = source
  result = train(config, str(tmp_path / 'fine_tune'))
  # Its first loss is the source's final parameters on the first batch, computed independently.
  corpus, train_setup = setup(config)
  saved = Checkpointer(os.path.join(source, 'checkpoints'), 1, 1).restore(
      3, train_setup.abstract_state(), data.train_iterator(corpus, config.data, config.seed))
  reference = ReferenceRun(train_setup.model, config.optim, 1, config.seed)
  reference.params = jax.device_get(saved['params'])
  expected, _ = reference.gradients(train_batches(config)[1][0])
  np.testing.assert_allclose(result.train_losses[1], float(expected), atol=1e-5)
  fresh = single_device_run(config, 1).losses[0]
  assert abs(fresh - result.train_losses[1]) > 1e-3  # Not the fresh initialisation.
  config.model.num_layers = 3
  with pytest.raises(ValueError, match='does not fit this model'):
    train(config, str(tmp_path / 'other_model'))
