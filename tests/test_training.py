"""End-to-end training: the loss falls on real text; a resumed run continues exactly."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import data, parallel
from engine.analysis.reference import ReferenceRun
from engine.checkpoint import Checkpointer
from engine.assemble import assemble
from engine.finiteness import NonFiniteError
from engine.train import train
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
  # Stop after 5 steps (checkpoints at 4 and a final one at 5), and lose the last checkpoint as
  # if killed after logging step 5 but before saving it: the rerun redoes step 5.
  first = train(_resumable_config((2, 2, 2), 5), str(tmp_path / 'split'))
  shutil.rmtree(tmp_path / 'split' / 'checkpoints' / '5')
  second = train(_resumable_config((2, 2, 2), 8), str(tmp_path / 'split'))
  assert sorted(second.train_losses) == [5, 6, 7, 8]
  split = {**first.train_losses, **second.train_losses}
  for step in range(1, 9):
    np.testing.assert_allclose(split[step], full.train_losses[step], rtol=0, atol=1e-6)
  # The metrics file holds every step once, the redone step 5 as the rerun logged it.
  with open(tmp_path / 'split' / 'metrics.jsonl') as f:
    train_lines = [json.loads(line) for line in f if 'train/loss' in line]
  assert [line['step'] for line in train_lines] == list(range(1, 9))
  assert train_lines[4]['train/loss'] == pytest.approx(second.train_losses[5])


def _poison_step(monkeypatch, nan_step: int) -> None:
  """Makes the train step of both modes produce NaN parameters and loss at `nan_step`."""
  for mode, build in list(parallel.STEP_BUILDERS.items()):
    def poisoned(setup, build=build):
      steps = build(setup)

      def train_step(state, tokens):
        state, metrics = steps.train(state, tokens)
        bad = state['step'] == nan_step
        state['params'] = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p), state['params'])
        return state, dict(metrics, loss=jnp.where(bad, jnp.nan, metrics['loss']))

      return dataclasses.replace(steps, train=jax.jit(train_step, donate_argnums=0))
    monkeypatch.setitem(parallel.STEP_BUILDERS, mode, poisoned)


@pytest.mark.parametrize('nan_step, last_good', [(5, 4), (4, 2)])
def test_a_step_that_is_not_finite_stops_the_run_and_is_never_saved(
    nan_step, last_good, monkeypatch, tmp_path):
  # Step 5 is checked while step 6 runs; step 4 is due for a checkpoint, checked before saving.
  _poison_step(monkeypatch, nan_step)
  with pytest.raises(NonFiniteError, match=rf'Step {nan_step}: the train loss is nan.*'
                     rf'of step {last_good}, is untouched'):
    train(_resumable_config((2, 2, 2), 6), str(tmp_path))
  checkpointer = Checkpointer(str(tmp_path / 'checkpoints'), 2, 3)
  assert checkpointer.latest_step() == last_good
  checkpointer.close()
  assert not [p for p in os.listdir(tmp_path / 'checkpoints') if 'tmp' in p]


def test_skip_nonfinite_steps_keeps_the_state_and_counts_them(monkeypatch, tmp_path):
  """With train.skip_nonfinite_steps, a step whose gradients are NaN changes nothing and the run
  goes on; one more in a row than allowed stops it as before."""
  from engine.parallel import auto, manual
  for module in (auto, manual):
    def poisoned(setup, state, loss, grads, grad_norm, original=module.apply_update):
      bad = (state['step'] + 1 == 3) | (state['step'] + 1 >= 5)  # Steps 3, 5, 6, ...
      nan = jnp.where(bad, jnp.nan, 1.0)
      return original(setup, state, loss * nan, jax.tree.map(lambda g: g * nan, grads),
                      grad_norm * nan)
    monkeypatch.setattr(module, 'apply_update', poisoned)
  config = _resumable_config((2, 2, 2), 6)
  config.parallelism.mode = 'manual'
  config.train.skip_nonfinite_steps = 1
  with pytest.raises(NonFiniteError, match='Step 6: the train loss is nan'):
    train(config, str(tmp_path))
  # Steps 3 and 5 were skipped (one in a row each time); step 6 was the second in a row, so it
  # stopped the run unsaved. Checkpoints 2 and 4 were written.
  checkpointer = Checkpointer(str(tmp_path / 'checkpoints'), 2, 3)
  assert checkpointer.latest_step() == 4
  checkpointer.close()
  lines = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert [l['step'] for l in lines if 'train/loss' in l and np.isnan(l['train/loss'])] == [3, 5]
  # The skipped steps left the parameters finite: step 4 (after skipped 3) trained normally.
  assert np.isfinite([l['train/loss'] for l in lines if l['step'] == 4 and 'train/loss' in l])


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
  run = assemble(config)
  corpus, train_setup = run.corpus, run.setup
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
