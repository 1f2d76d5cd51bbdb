"""The mixture-of-experts layer (engine/models/moe.py) and the Llama model built with it.

The layer is checked against a NumPy loop over tokens and their top-k experts written here, for
both routers and both dispatches (capacity with so few slots that assignments drop), with its
load-balancing and z-losses; the model's loss and gradients against its single-device run (as
tests/test_llama.py) in auto mode on 2x2x2 and in manual mode on 2x2x2 and data x context
(dropless: the routing statistics averaged over the batch shards) and on a tensor-only mesh
(capacity), and the refusal of the layouts it does not support yet (router statistics and
pipeline stages: tests/test_moe_stats.py).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from engine.analysis.reference import ReferenceRun
from engine.config import ConfigError
from engine import models
from engine.models import moe
from engine.models.ops import LocalOps
from engine.validation import validate
from tests.helpers import assert_same_run, engine_run, single_device_run, tiny_config

D, E, K, F, S = 8, 4, 2, 16, 6  # embed, experts, experts per token, expert hidden, shared.


def _silu(x):
  return x / (1 + np.exp(-x))


def _numpy_layer(x_TD, p, router, slots):
  """(y [T, D], balance loss, z-loss, dropped count): token by token, choice by choice."""
  logits = x_TD @ p['w_router_DE']
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  used, dropped, y = np.zeros(E, int), 0, np.zeros_like(x_TD)
  chosen_TK = np.argsort(-logits, axis=-1, kind='stable')[:, :K]
  for t, x in enumerate(x_TD):
    chosen = chosen_TK[t]
    if router == 'softmax_topk':
      weights = probs[t, chosen] / probs[t, chosen].sum()
    else:
      weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
      weights /= weights.sum()
    for e, w in zip(chosen, weights):
      used[e] += 1
      if slots is not None and used[e] > slots:
        dropped += 1  # Contributes nothing.
        continue
      h = _silu(x @ p['w_gate_EDF'][e]) * (x @ p['w_up_EDF'][e])
      y[t] += w * (h @ p['w_down_EFD'][e])
    y[t] += (_silu(x @ p['w_shared_gate_DS']) * (x @ p['w_shared_up_DS'])) @ p['w_shared_down_SD']
  fraction = np.bincount(chosen_TK.ravel(), minlength=E) / chosen_TK.size
  balance = E * np.sum(fraction * probs.mean(0))
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return y, balance, np.mean(lse ** 2), dropped


@pytest.mark.parametrize('router', moe.ROUTERS)
def test_layer_matches_a_numpy_loop(router):
  x_BLD = np.asarray(jax.random.normal(jax.random.key(1), (3, 4, D)))
  T = x_BLD.shape[0] * x_BLD.shape[1]
  for dispatch, factor in (('dropless', 1.0), ('capacity', 0.5), ('capacity', 4.0)):
    cfg = moe.MoeConfig(E, F, K, router, S, dispatch, factor, aux_loss_coef=0.1,
                        z_loss_coef=0.01)
    with nnx.use_eager_sharding(False):
      layer = moe.MoeMlp(D, cfg, 0.5, nnx.Rngs(0))
    params = {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}
    y, aux, stats = layer(x_BLD, LocalOps())
    slots = moe.capacity(T, K, E, factor) if dispatch == 'capacity' else None
    y_np, balance, z, dropped = _numpy_layer(x_BLD.reshape(T, D), params, router, slots)
    np.testing.assert_allclose(np.asarray(y).reshape(T, D), y_np, atol=1e-5, err_msg=dispatch)
    np.testing.assert_allclose(float(stats['balance']), balance, rtol=1e-5)
    np.testing.assert_allclose(float(stats['z']), z, rtol=1e-5)
    np.testing.assert_allclose(float(aux), 0.1 * balance + 0.01 * z, rtol=1e-5)
    np.testing.assert_allclose(float(stats['dropped']), dropped / (T * K), atol=1e-7)
    if factor == 0.5:  # 3 slots per expert for 24 assignments: at least half are dropped.
      assert slots == 3 and dropped >= T * K - E * slots
    else:
      assert dropped == 0


def moe_config(mesh=(1, 1, 1), dispatch='dropless', mode='auto'):
  config = tiny_config(mesh=mesh[:3], steps=2)
  config.mesh.context = mesh[3] if len(mesh) > 3 else 1
  config.model.name = 'llama'
  config.model.num_heads = 8  # tensor=8 splits the heads too.
  config.model.tie_embeddings = False
  config.model.num_experts = 4
  config.model.moe_mlp_dim = 32
  config.model.moe_shared_expert = 16
  config.model.moe_dispatch = dispatch
  config.model.moe_capacity_factor = 0.5  # Half the slots the assignments need: many drop.
  config.model.moe_aux_loss_coef = 0.1
  config.model.moe_z_loss_coef = 0.01
  config.parallelism.mode = mode
  return config


@pytest.mark.parametrize('dispatch, layouts', [
    ('dropless', [('auto', (2, 2, 2)), ('manual', (2, 2, 2)), ('manual', (4, 1, 1, 2))]),
    ('capacity', [('auto', (2, 2, 2)), ('manual', (1, 1, 8))])])
def test_model_matches_single_device(dispatch, layouts):
  reference = single_device_run(moe_config(dispatch=dispatch), 2)
  for mode, mesh in layouts:
    assert_same_run(engine_run(moe_config(mesh, dispatch, mode), mode, 2), reference)


def test_the_auxiliary_losses_are_in_the_training_loss():
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (4, 9), 0, 64))
  router_gradients = []
  for coef in (0.1, 0.0):
    config = moe_config()
    config.model.moe_aux_loss_coef = config.model.moe_z_loss_coef = coef
    run = ReferenceRun(models.build(config.model, 64), config.optim, 2, 0)
    loss, grads = run.gradients(tokens)
    model = nnx.merge(run.graphdef, run.params)
    logits = np.asarray(model(tokens[:, :-1]), np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    cross_entropy = np.mean(lse - np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
    aux = float(model.logits_and_aux_loss(tokens[:, :-1])[1])
    np.testing.assert_allclose(float(loss), cross_entropy + aux, atol=1e-5)
    assert (aux > 0.1) if coef else aux == 0  # 2 layers x 0.1 x a balance loss near 1, + z.
    router_gradients.append(np.asarray(grads['blocks']['moe']['w_router_DE']))
  # The auxiliary losses are differentiated: the router's gradient moves with them.
  assert np.abs(router_gradients[0] - router_gradients[1]).max() > 1e-4


@pytest.mark.parametrize('dispatch, mode, mesh, message', [
    ('capacity', 'manual', (2, 2, 2), "model.moe_dispatch='capacity' in manual mode on a mesh "
     'that splits the tokens'),
    ('capacity', 'manual', (1, 1, 8), None),
    ('dropless', 'manual', (2, 2, 2), None),
    ('dropless', 'auto', (2, 2, 1, 1, 2), None)])  # Pipeline stages: tests/test_moe_stats.py.
def test_unsupported_layouts_are_refused(dispatch, mode, mesh, message):
  config = moe_config(mesh[:4], dispatch, mode)
  config.mesh.stage = config.train.microbatches = mesh[4] if len(mesh) > 4 else 1
  if message is None:
    validate(config, 8)
    return
  with pytest.raises(ConfigError, match=message):
    validate(config, 8)
