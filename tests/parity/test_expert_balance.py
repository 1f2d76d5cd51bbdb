"""Auxiliary-loss-free expert balancing (model.moe_balance='aux_free',
engine/models/moe/balance.py).

The router's choice with the bias and its update from the load are checked against NumPy; the
model then equals its single-device run (losses, gradients, every parameter and so the bias after
2 steps) in both modes on the expert, fsdp x tensor x expert and stage meshes, with gradient
accumulation and with the 1F1B schedule. The bias moves the reference far beyond the tolerance
(the parity can fail), and a bias updated with another stage's load is caught. A run stopped and
resumed chooses with the bias it saved, as an uninterrupted run does.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.models.moe import balance as expert_balance
from engine.models.moe import layer as moe
from engine.parallel import manual
from engine.train.loop import train
from engine.train.metrics import router_health
from tests.parity.test_moe import BEST, GROUPS, SCALE, moe_config
from tests.support.helpers import ATOL, PARAM_ATOL, assert_same_run, engine_run, single_device_run

# Large enough that the second step's choices differ from the first's, small enough that no
# step turns every token to other experts (the tiny router's scores are close).
RATE = 0.003


def _numpy_choice(logits_TE, bias_E, k, router):
  """(experts [T, k], weights [T, k]) token by token: the top k of the biased scores (sigmoid
  groups as DeepSeek-V3's, scored by their two best biased scores), weighed by the plain ones."""
  sigmoid = 1 / (1 + np.exp(-logits_TE))
  softmax = np.exp(logits_TE - logits_TE.max(-1, keepdims=True))
  softmax /= softmax.sum(-1, keepdims=True)
  scores = {'sigmoid_topk': sigmoid, 'softmax_topk': softmax, 'topk_softmax': logits_TE}[router]
  experts, weights = [], []
  for plain in scores:
    biased = plain + bias_E
    if router == 'sigmoid_topk':
      by_group = biased.reshape(GROUPS, -1)
      best = np.argsort(-np.sort(by_group, 1)[:, ::-1][:, :2].sum(1), kind='stable')[:BEST]
      biased = np.where(np.isin(np.arange(plain.size) // by_group.shape[1], best), biased,
                        -np.inf)
    chosen = np.argsort(-biased, kind='stable')[:k]
    w = plain[chosen]
    if router == 'topk_softmax':
      w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
    else:
      w = w / w.sum() * (SCALE if router == 'sigmoid_topk' else 1.0)
    experts.append(chosen)
    weights.append(w)
  return np.array(experts), np.array(weights)


@pytest.mark.parametrize('router', moe.ROUTERS)
def test_the_bias_chooses_the_experts_and_never_weighs_them(router):
  logits = np.asarray(jax.random.normal(jax.random.key(5), (64, 4)))
  bias = np.array([0.3, -0.2, 0.1, -0.4], np.float32)
  groups = (GROUPS, BEST, SCALE) if router == 'sigmoid_topk' else ()
  weights, experts, _ = moe.route(jnp.asarray(logits), 2, router, *groups,
                                  bias_E=jnp.asarray(bias))
  expected_experts, expected_weights = _numpy_choice(logits, bias, 2, router)
  np.testing.assert_array_equal(np.asarray(experts), expected_experts)
  np.testing.assert_allclose(np.asarray(weights), expected_weights, rtol=1e-5)
  unbiased = _numpy_choice(logits, np.zeros(4, np.float32), 2, router)[0]
  assert (np.sort(unbiased, 1) != np.sort(expected_experts, 1)).any(1).sum() >= 5
  # No gradient reaches the bias: only the choice reads it.
  grad = jax.grad(lambda b: moe.route(jnp.asarray(logits), 2, router, *groups, bias_E=b)[0].sum())(
      jnp.asarray(bias))
  np.testing.assert_array_equal(np.asarray(grad), 0)


def test_the_bias_moves_by_the_rate_toward_the_mean_load():
  counts = np.array([[30, 10, 20, 20], [5, 35, 20, 20]])  # Each layer's assignments per expert.
  load = counts / counts.sum(1, keepdims=True)
  bias = np.array([[0.01, 0.0, -0.02, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
  expected = bias + RATE * np.array([[-1, 1, 0, 0], [1, -1, 0, 0]])
  np.testing.assert_allclose(np.asarray(expert_balance.updated_bias(
      jnp.asarray(bias), jnp.asarray(load, jnp.float32), RATE)), expected, rtol=1e-6)


def test_the_log_line_shows_the_bias_range():
  scalars = {'moe/load_min': 0.7, 'moe/load_max': 1.3, 'moe/load_cv': 0.2,
             'moe/dropped_fraction': 0.0, 'moe/bias_min': -0.03, 'moe/bias_max': 0.06}
  assert router_health(scalars).endswith('dropped 0.0% bias -0.030..+0.060')


def aux_free(config, router='sigmoid_topk', rate=RATE):
  """The bias alone, as DeepSeek-V3 balances (no Switch loss: with micro-batches or stages it is
  a product of micro-batch means, the reference's of whole-batch ones)."""
  config.model.moe_balance, config.model.moe_bias_rate = 'aux_free', rate
  config.model.moe_aux_loss_coef = 0.0
  config.model.moe_router = router
  if router == 'sigmoid_topk':
    config.model.moe_groups, config.model.moe_topk_groups = GROUPS, BEST
    config.model.moe_routed_scale = SCALE
  return config


def _stage_config(mode='auto', schedule='gpipe'):
  """expert 2 x stage 2 x data 2, 2 micro-batches; softmax routing, whose two layers' biases
  differ here (so a bias moved by the other stage's load shows)."""
  config = aux_free(moe_config((2, 1, 1, 1, 2, 2), mode=mode), 'softmax_topk')
  config.train.microbatches = 2
  config.train.pipeline_schedule = schedule
  return config


@pytest.fixture(scope='module')
def references():
  return {'sigmoid': single_device_run(aux_free(moe_config()), 2),
          'stage': single_device_run(aux_free(moe_config(), 'softmax_topk'), 2)}


@pytest.mark.slow
def test_the_bias_moves_the_reference_far_beyond_the_tolerance(references):
  still = single_device_run(aux_free(moe_config(), rate=1e-12), 2)
  assert abs(references['sigmoid'].losses[1] - still.losses[1]) > 10 * ATOL
  for run in references.values():  # Whole steps of the rate, some of them taken.
    bias = run.params[f"['blocks']['moe']['{expert_balance.ROUTER_BIAS}']"]
    np.testing.assert_allclose(bias / RATE, np.round(bias / RATE), atol=1e-4)
    assert np.abs(bias).max() > 10 * PARAM_ATOL
  stage_bias = references['stage'].params[f"['blocks']['moe']['{expert_balance.ROUTER_BIAS}']"]
  assert (stage_bias[0] != stage_bias[1]).any()


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_aux_free_balancing_matches_single_device(mode, references):
  """expert 4 x data 2 with 2 micro-batches accumulated, expert 2 x fsdp 2 x tensor 2 in one,
  and the stage mesh with GPipe and 1F1B. Guards each layer's load reaching its own bias
  through a pipeline: auto GPipe's stages keeping their own layer counters fails it."""
  for mesh, microbatches in (((2, 1, 1, 1, 1, 4), 2), ((1, 2, 2, 1, 1, 2), 1)):
    config = aux_free(moe_config(mesh, mode=mode))
    config.train.microbatches = microbatches
    assert_same_run(engine_run(config, mode, 2), references['sigmoid'])
  for schedule in ('gpipe', '1f1b'):
    assert_same_run(engine_run(_stage_config(mode, schedule), mode, 2), references['stage'])


@pytest.mark.slow
def test_a_bias_moved_by_another_stages_load_is_caught(references, monkeypatch):
  """Manual mode's stages each hold their layers' biases: a step that moved them all by the
  first stage's layers' load fails the parity."""
  def first_stages_block(self, whole, path, local):
    return whole.reshape(-1, whole.shape[-1])[:local.shape[0]].reshape(local.shape)
  monkeypatch.setattr(manual._BiasBlocks, 'block', first_stages_block)
  with pytest.raises(AssertionError):  # The second step's loss already differs.
    assert_same_run(engine_run(_stage_config('manual'), 'manual', 2), references['stage'])


def _bias_range(workdir):
  lines = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  return {l['step']: (l['moe/bias_min'], l['moe/bias_max']) for l in lines if 'moe/bias_min' in l}


@pytest.mark.slow
def test_a_resumed_run_chooses_with_the_bias_it_saved(tmp_path):
  """4 steps at once, and 2 + 2 from the checkpoint of step 2: the same losses and the same
  bias, step by step (a bias lost on resume would route step 3 differently)."""
  def config(steps):
    c = aux_free(moe_config((2, 2, 2)))
    c.train.num_steps, c.train.checkpoint_every, c.optim.decay_steps = steps, 2, 8
    return c
  whole = train(config(4), str(tmp_path / 'whole'))
  train(config(2), str(tmp_path / 'split'))
  resumed = train(config(4), str(tmp_path / 'split'))
  assert sorted(resumed.train_losses) == [3, 4]
  for step in (3, 4):
    np.testing.assert_allclose(resumed.train_losses[step], whole.train_losses[step], atol=1e-6)
  ranges = _bias_range(tmp_path / 'whole')
  assert ranges[1] == (0.0, 0.0) != ranges[3]
  assert _bias_range(tmp_path / 'split') == ranges
