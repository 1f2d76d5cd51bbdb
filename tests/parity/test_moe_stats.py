"""The mixture of experts' router health in the train step's metrics, through the layer stack and
pipeline stages (engine.parallel.steps.model_metrics), in metrics.jsonl and the log line.

The metrics of one compiled step are checked against NumPy's routing of the same tokens (each
layer's router logits from its input, top-k, capacity slots per sequence in (position, choice) order). With
pipeline stages, each micro-batch's statistics count once: the token means (z-loss, load) equal
the whole batch's, and the balance loss is the mean of the micro-batches' own (a product of
micro-batch means); the losses and gradients match the single-device run with the balance loss
off (moe_aux_loss_coef=0: that run takes the product over the whole batch).
"""

import json
import logging
import math

import jax
import numpy as np
import pytest
from flax import nnx

from engine import parallel
from engine.assemble import lay_out
from engine.train.metrics import MetricsWriter
from engine.models.ops import LocalOps
from engine.train.loop import DeferredMetrics, TrainResult
from tests.support.helpers import Run, assert_same_run, single_device_run, train_batches
from tests.parity.test_moe import moe_config

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

KEYS = {'moe/balance_loss', 'moe/z_loss', 'moe/dropped_fraction', 'moe/load_min',
        'moe/load_max', 'moe/load_cv'}


def _steps(config, mode, num_steps=1):
  """(metrics of the first train step, the model with the initial parameters, the first batch,
  the run as tests.support.helpers.engine_run records it)."""
  corpus, batches = train_batches(config)
  setup = lay_out(config, corpus.tokenizer.vocab_size)
  state, _ = setup.init(config.seed)
  model = nnx.merge(setup.graphdef, jax.device_get(state['params']))
  steps = parallel.build_steps(mode, setup)
  on_mesh = lambda batch: jax.device_put(batch, setup.batch_sharding())
  # The gradients step compiles too: only for the runs compared with the reference.
  first_gradients = (steps.gradients(state['params'], on_mesh(batches[0]))[1]
                     if num_steps > 1 else {})
  metrics = []
  for i in range(num_steps):
    state, step_metrics = steps.train(state, on_mesh(batches[i]))
    metrics.append({k: float(v) for k, v in step_metrics.items()})
  run = Run(np.array([m['loss'] for m in metrics]), np.array([m['grad_norm'] for m in metrics]),
            _by_path(first_gradients), _by_path(state['params']))
  return metrics[0], model, np.asarray(batches[0]), run


def _by_path(tree):
  return {jax.tree_util.keystr(path): np.asarray(value)
          for path, value in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def _forward(model, inputs_BL):
  """(each layer's router logits [T, E], the model's logits [B, L, V]) in float64: the router's
  input taken from that layer's own input (the layers run one by one, in one jitted call)."""
  graphdef, stacked = nnx.split(model.blocks)

  @jax.jit
  def router_inputs(stacked, model_params):
    x_BLD, inputs = model.tok_embed_VD[...][inputs_BL], []
    for layer in range(model.cfg.num_layers):
      block = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer: a[i], stacked))
      attended_BLD = x_BLD + block.attention(block.attn_norm(x_BLD), LocalOps())
      inputs.append(block.mlp_norm(attended_BLD).reshape(-1, x_BLD.shape[-1]))
      x_BLD = block(x_BLD, LocalOps())
    return inputs, nnx.merge(*model_params)(inputs_BL)

  inputs, out_BLV = router_inputs(stacked, nnx.split(model))
  routers = np.asarray(stacked['moe']['w_router_DE'].get_value(), np.float64)
  return ([np.asarray(h, np.float64) @ w for h, w in zip(inputs, routers)],
          np.asarray(out_BLV, np.float64))


def _routing(logits_TE, k, slots=None, length=None):
  """(load [E] as multiples of the mean, dropped fraction, balance loss, z-loss) of one layer;
  each expert takes at most `slots` assignments of each sequence of `length` tokens."""
  T, E = logits_TE.shape
  chosen_A = np.argsort(-logits_TE, axis=-1, kind='stable')[:, :k].ravel()  # (token, choice)
  fraction_E = np.bincount(chosen_A, minlength=E) / chosen_A.size
  used, dropped = np.zeros(E, int), 0
  for a, e in enumerate(chosen_A):
    if length and a % (length * k) == 0:
      used[:] = 0  # A new sequence: every expert's slots are free again.
    used[e] += 1
    dropped += slots is not None and used[e] > slots
  probs_TE = np.exp(logits_TE - logits_TE.max(-1, keepdims=True))
  probs_TE /= probs_TE.sum(-1, keepdims=True)
  lse_T = np.log(np.exp(logits_TE - logits_TE.max(-1, keepdims=True)).sum(-1)) + (
      logits_TE.max(-1))
  return (fraction_E * E, dropped / chosen_A.size, E * np.sum(fraction_E * probs_TE.mean(0)),
          np.mean(lse_T ** 2))


def _expected(logits, k, slots=None, length=None):
  """The metrics of NumPy's routing, layer by layer."""
  loads, dropped, balance, z = zip(*[_routing(l, k, slots, length) for l in logits])
  loads = np.stack(loads)
  return {'moe/load_min': loads.min(), 'moe/load_max': loads.max(),
          'moe/load_cv': np.mean(loads.std(-1) / loads.mean(-1)),
          'moe/dropped_fraction': np.mean(dropped), 'moe/balance_loss': np.mean(balance),
          'moe/z_loss': np.mean(z)}


def test_router_health_matches_numpy_routing():
  """Auto mode on 2x2x2, capacity with half the slots needed: the metrics, and the loss (the
  cross-entropy plus the layers' weighted losses, summed over the layers) unchanged."""
  config = moe_config((2, 2, 2), 'capacity', 'auto')
  metrics, model, tokens_BL1, _ = _steps(config, 'auto')
  assert set(metrics) == {'loss', 'grad_norm', 'learning_rate'} | KEYS
  moe = model.cfg.moe
  logits, out_BLV = _forward(model, tokens_BL1[:, :-1])
  L = tokens_BL1.shape[1] - 1
  slots = math.ceil(L * moe.experts_per_token / moe.num_experts * moe.capacity_factor)
  expected = _expected(logits, moe.experts_per_token, slots, L)
  for name, value in expected.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  assert 0.3 < metrics['moe/dropped_fraction'] < 0.7  # Half the slots: about half dropped.
  assert metrics['moe/load_min'] < 1 < metrics['moe/load_max']
  lse_BL = np.log(np.exp(out_BLV - out_BLV.max(-1, keepdims=True)).sum(-1)) + out_BLV.max(-1)
  cross_entropy = np.mean(lse_BL - np.take_along_axis(out_BLV, tokens_BL1[:, 1:, None], -1)[
      ..., 0])
  layers = model.cfg.num_layers
  np.testing.assert_allclose(metrics['loss'], cross_entropy + layers * (
      0.1 * expected['moe/balance_loss'] + 0.01 * expected['moe/z_loss']), rtol=1e-5)


def _pipeline_config(mode):
  config = moe_config((4, 1, 1), 'dropless', mode)
  config.mesh.stage = 2
  config.train.microbatches = 2
  config.model.moe_aux_loss_coef = 0.0  # The reference's balance loss is the whole batch's.
  return config


@pytest.fixture(scope='module')
def pipeline_reference():
  return single_device_run(_pipeline_config('auto'), 2)


@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_pipeline_stages_with_experts(mode, pipeline_reference):
  """data 4 x stage 2, 2 micro-batches: the single-device run, and each micro-batch's router
  statistics counted once, bubbles never."""
  config = _pipeline_config(mode)
  metrics, model, tokens_BL1, run = _steps(config, mode, 2)
  k = model.cfg.moe.experts_per_token
  logits = _forward(model, tokens_BL1[:, :-1])[0]
  whole = _expected(logits, k)
  for name in ('moe/load_min', 'moe/load_max', 'moe/load_cv', 'moe/z_loss'):
    np.testing.assert_allclose(metrics[name], whole[name], rtol=1e-5, err_msg=name)
  assert metrics['moe/dropped_fraction'] == 0
  # Rows are routed independently: micro-batch m's logits are its rows' (m, m + 2, ...).
  B = tokens_BL1.shape[0]
  micro_balance = [_expected([l.reshape(B, -1, l.shape[-1])[m::2].reshape(-1, l.shape[-1])
                              for l in logits], k)['moe/balance_loss'] for m in range(2)]
  np.testing.assert_allclose(metrics['moe/balance_loss'], np.mean(micro_balance), rtol=1e-5)
  assert abs(np.mean(micro_balance) - whole['moe/balance_loss']) > 1e-4  # Not the same thing.
  assert_same_run(run, pipeline_reference)


class _NoPeakMemory:

  def read(self):
    return None, 'compiled estimate'


def test_router_health_in_log_line_and_metrics_file(tmp_path, caplog):
  """The train loop's logging of a dense step (no router part) and a MoE step: the log line's
  router health, and the moe/* scalars in metrics.jsonl."""
  writer = MetricsWriter(tmp_path, num_steps=2, tokens_per_step=16)
  result = TrainResult({}, {}, {}, 0, {})
  deferred = DeferredMetrics(writer, result, 1, 2, _NoPeakMemory())
  dense = {'loss': 2.5, 'grad_norm': 1.0, 'learning_rate': 1e-3}
  router = {'moe/balance_loss': 1.02, 'moe/z_loss': 1.9, 'moe/dropped_fraction': 0.003,
            'moe/load_min': 0.714, 'moe/load_max': 1.384, 'moe/load_cv': 0.2149}
  # On the absl logger itself: an earlier test in the session may have lowered absl's verbosity.
  with caplog.at_level(logging.INFO, logger='absl'):
    deferred.after_dispatch(1, None, dense)
    router_step = {**dense, **{k: jax.numpy.float32(v) for k, v in router.items()}}
    deferred.after_dispatch(2, None, router_step)
    deferred.flush()
  writer.close()
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('step ')]
  assert 'load' not in lines[0] and 'dropped' not in lines[0]
  assert 'loss 2.5000 | lr 1.00e-03 | grad norm 1.000 | load 0.71-1.38 cv 0.21 dropped 0.3%' in (
      lines[1])
  records = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert not KEYS & set(records[0])
  for name, value in router.items():
    assert records[1][name] == pytest.approx(value, rel=1e-6)
