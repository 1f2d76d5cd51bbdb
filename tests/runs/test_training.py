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
from engine.workdir.checkpoint import Checkpointer, latest_complete_step
from engine.assemble import assemble, lay_out
from engine.train.finiteness import NonFiniteError
from engine.train.loop import train
from tests.support.helpers import single_device_run, tiny_config, train_batches

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.


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


@pytest.fixture(scope='module')
def uninterrupted_8_steps(tmp_path_factory):
  """The run every resume is compared with (decay_steps fixes the schedule: its first steps are
  those of any shorter run)."""
  return train(_resumable_config((2, 2, 2), 8), str(tmp_path_factory.mktemp('full')))


def test_resume_continues_like_an_uninterrupted_run(uninterrupted_8_steps, tmp_path):
  full = uninterrupted_8_steps
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
  assert latest_complete_step(str(tmp_path / 'checkpoints')) == last_good
  assert not [p for p in os.listdir(tmp_path / 'checkpoints') if 'tmp' in p]


# The poison: a batch holding this token. The synthetic corpus's 32-letter alphabet has no NUL.
SENTINEL = 0


def _nan_loss_where_poisoned(monkeypatch) -> None:
  """Both modes' loss (so every gradient) is NaN on a device whose rows of the batch hold
  SENTINEL; in manual mode the other devices learn of it only through the collectives."""
  from engine.parallel import auto, manual
  for module in (auto, manual):
    def loss(params, graphdef, tokens_BL1, ops, original=module.next_token_loss, **options):
      poison = jnp.where(jnp.any(tokens_BL1 == SENTINEL), jnp.nan, 1.0)
      value = original(params, graphdef, tokens_BL1, ops, **options)
      # The train step's is (loss, statistics): with_stats.
      return (value[0] * poison, value[1]) if isinstance(value, tuple) else value * poison
    monkeypatch.setattr(module, 'next_token_loss', loss)


def _poisoned(batch: np.ndarray) -> np.ndarray:
  """The batch with SENTINEL in its first row only: on 2x2x2 only devices 0 and 1 hold it."""
  assert not (batch == SENTINEL).any()
  batch = batch.copy()
  batch[0, 0] = SENTINEL
  return batch


class _PoisonedIterator:
  """The engine's train iterator, whose batches of `steps` (1-based, from a fresh start) are
  poisoned."""

  def __init__(self, iterator, steps):
    self.iterator, self.steps, self.step = iterator, steps, 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self.iterator)
    self.step += 1
    return _poisoned(batch) if self.step in self.steps else batch

  def get_state(self):
    return self.iterator.get_state()

  def set_state(self, state):
    self.iterator.set_state(state)


def test_skip_nonfinite_steps_skips_exactly_the_poisoned_steps(monkeypatch, tmp_path):
  """With train.skip_nonfinite_steps=2 the loop skips exactly the steps whose batch was
  poisoned, up to 2 in a row (a finite step resets the count); a third in a row stops the run
  unsaved."""
  import engine.train.loop as train_module
  _nan_loss_where_poisoned(monkeypatch)
  monkeypatch.setattr(data, 'train_iterator', lambda *args, original=data.train_iterator:
                      _PoisonedIterator(original(*args), {2, 4, 5, 6}))
  results = []  # The run raises; its TrainResult is caught as it is made.

  class RecordedResult(train_module.TrainResult):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      results.append(self)

  monkeypatch.setattr(train_module, 'TrainResult', RecordedResult)
  config = _resumable_config((2, 2, 2), 6)
  config.parallelism.mode = 'manual'
  config.train.skip_nonfinite_steps = 2
  with pytest.raises(NonFiniteError, match='Step 6: the train loss is nan'):
    train(config, str(tmp_path))
  [result] = results
  assert result.skipped_steps == [2, 4, 5]
  # Checkpoints 2 and 4 (skipped steps leave a finite state, which is saved); step 6 stopped
  # the run before anything of it was saved.
  assert latest_complete_step(str(tmp_path / 'checkpoints')) == 4
  lines = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  losses = {l['step']: l['train/loss'] for l in lines if 'train/loss' in l}
  assert sorted(losses) == [1, 2, 3, 4, 5]
  assert [step for step, loss in losses.items() if not np.isfinite(loss)] == [2, 4, 5]


def _per_device(tree) -> list[tuple[str, int, bytes]]:
  """(path, device, bytes) of every shard of every leaf: each device's copy, bit for bit."""
  return [(jax.tree_util.keystr(path), shard.device.id, np.asarray(shard.data).tobytes())
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
          for shard in leaf.addressable_shards]


def test_a_skipped_step_keeps_parameters_and_optimizer_state_bit_for_bit(monkeypatch):
  """The compiled manual step (skip_nonfinite on) on 4 batches, the 2nd and 3rd poisoned in one
  row (so on 2 of the 8 devices): after each poisoned step every device's parameters and
  optimizer state are bit-for-bit those before it, and only the step counter moved; the finite
  steps 1 and 4 change every parameter and every optimizer state leaf."""
  _nan_loss_where_poisoned(monkeypatch)
  config = tiny_config(mesh=(2, 2, 2), steps=4)
  config.train.skip_nonfinite_steps = 1
  corpus, batches = train_batches(config)
  train_setup = lay_out(config, corpus.tokenizer.vocab_size)
  assert train_setup.options.skip_nonfinite
  train_step = parallel.build_steps('manual', train_setup).train
  state, _ = train_setup.init(config.seed)
  sharding = train_setup.batch_sharding()
  poisoned = {2, 3}
  kept = lambda s: _per_device({'params': s['params'], 'opt_state': s['opt_state']})
  for step in range(1, 5):
    before = kept(state)  # Host copies: the step donates `state`.
    batch = _poisoned(batches[step - 1]) if step in poisoned else batches[step - 1]
    state, metrics = train_step(state, jax.device_put(batch, sharding))
    after = kept(state)
    finite = [np.isfinite(float(metrics[k])) for k in ('loss', 'grad_norm')]
    assert int(state['step']) == step  # The counter counts every step, skipped or not.
    assert [(path, device) for path, device, _ in after] == [(p, d) for p, d, _ in before]
    changed = {path for (path, _, a), (_, _, b) in zip(after, before) if a != b}
    if step in poisoned:
      assert finite == [False, False], step
      assert not changed, (step, sorted(changed))
    else:
      assert finite == [True, True], step
      assert changed == {path for path, _, _ in after}, step  # Every leaf moved.
      assert all(np.isfinite(np.frombuffer(a, np.float32)).all()
                 for path, _, a in after if 'count' not in path)


@pytest.mark.parametrize('first, second', [('auto', 'manual'), ('manual', 'auto')])
def test_resume_in_the_other_mode_on_another_mesh(first, second, uninterrupted_8_steps, tmp_path):
  full = uninterrupted_8_steps
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
