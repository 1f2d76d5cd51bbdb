"""The mixture-of-experts layer (engine/models/moe/layer.py) and the Llama model built with it.

The layer is checked against a NumPy loop over tokens and their top-k experts written here, for
both routers and both dispatches (capacity with so few slots that assignments drop, counted per
sequence), with its load-balancing and z-losses. The model's loss and gradients match its
single-device run (as tests/parity/test_llama.py) in both modes with both dispatches on the expert
meshes expert 4 x data 2, expert 2 x fsdp 2 x tensor 2 and expert 2 x stage 2 x data 2 (tokens
exchanged by all-to-all), and with dropless on data x context in manual mode (the routing
statistics averaged over the sequence's devices). The parity check catches an expert gradient
averaged over the expert axis; manual mode's all-to-all bytes equal the communication theory;
the dropless exchange by ragged all-to-all (TPU's and GPU's, in both modes) equals one device
through an emulation of the primitive, and compiled for TPU sends no whole block; the expert
axis' layout, and the refusals. Router statistics: tests/parity/test_moe_stats.py; the
auxiliary-loss-free bias: tests/parity/test_expert_balance.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine import models, parallel
from engine.analysis import comm_theory
from engine.analysis.reference import ReferenceRun
from engine.assemble import lay_out
from engine.errors import ConfigError
from engine.models.moe import layer as moe
from engine.models.ops import LocalOps
from engine.parallel import expert_exchange, manual_ops
from engine.plan import planner as plan_lib
from engine.validation import validate
from tests.support import ragged_exchange
from tests.support.helpers import (assert_same_run, collective_table, compiled_train_step,
                                   engine_run, single_device_run, tiny_config)

D, E, K, F, S = 8, 4, 2, 16, 6  # embed, experts, experts per token, expert hidden, shared.


def _silu(x):
  return x / (1 + np.exp(-x))


# sigmoid_topk's setting here: two groups of two experts, a token picks from the best one, and
# the weights are scaled (DeepSeek-V3's form, small).
GROUPS, BEST, SCALE = 2, 1, 2.5


def _numpy_sigmoid_route(logits_TE, k, groups, best):
  """Experts [T, k] of DeepSeek-V3's group-limited routing, token by token: a group scores its
  two best sigmoid scores' sum; the top k experts of the `best` best groups."""
  scores = 1 / (1 + np.exp(-logits_TE))
  chosen = []
  for s in scores:
    by_group = s.reshape(groups, -1)
    group_scores = np.sort(by_group, axis=1)[:, ::-1][:, :2].sum(1)
    keep = np.argsort(-group_scores, kind='stable')[:best]
    eligible = np.where(np.isin(np.arange(s.size) // by_group.shape[1], keep), s, -np.inf)
    chosen.append(np.argsort(-eligible, kind='stable')[:k])
  return scores, np.array(chosen)


def _numpy_layer(x_TD, p, router, slots, length):
  """(y [T, D], balance loss, z-loss, dropped count): token by token, choice by choice; each
  expert takes at most `slots` assignments of each sequence of `length` tokens."""
  logits = x_TD @ p['w_router_DE']
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  used, dropped, y = np.zeros(E, int), 0, np.zeros_like(x_TD)
  chosen_TK = np.argsort(-logits, axis=-1, kind='stable')[:, :K]
  if router == 'sigmoid_topk':
    scores, chosen_TK = _numpy_sigmoid_route(logits, K, GROUPS, BEST)
    probs = scores / scores.sum(-1, keepdims=True)
  for t, x in enumerate(x_TD):
    if t % length == 0:
      used[:] = 0  # A new sequence: every expert's slots are free again.
    chosen = chosen_TK[t]
    if router == 'softmax_topk':
      weights = probs[t, chosen] / probs[t, chosen].sum()
    elif router == 'sigmoid_topk':
      weights = SCALE * scores[t, chosen] / scores[t, chosen].sum()
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


def test_sigmoid_routing_picks_within_the_best_groups_as_numpy_does():
  """DeepSeek-V3's routing on 8 experts in 4 groups, 3 experts from the best 2 groups, against
  the NumPy loop; and the group limit matters here (plain top 3 differs for some tokens, so a
  router that ignored the groups would fail)."""
  logits = np.asarray(jax.random.normal(jax.random.key(3), (64, 8)))
  weights, experts, probs = moe.route(jnp.asarray(logits), 3, 'sigmoid_topk', 4, 2, 2.5)
  scores, expected = _numpy_sigmoid_route(logits, 3, 4, 2)
  np.testing.assert_array_equal(np.asarray(experts), expected)
  chosen_scores = np.take_along_axis(scores, expected, axis=1)
  np.testing.assert_allclose(np.asarray(weights), 2.5 * chosen_scores /
                             chosen_scores.sum(1, keepdims=True), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(probs), scores / scores.sum(1, keepdims=True), rtol=1e-6)
  plain = np.argsort(-scores, axis=1, kind='stable')[:, :3]
  assert (np.sort(plain, 1) != np.sort(expected, 1)).any(axis=1).sum() >= 5


@pytest.mark.parametrize('router', moe.ROUTERS)
def test_layer_matches_a_numpy_loop(router):
  x_BLD = np.asarray(jax.random.normal(jax.random.key(1), (3, 4, D)))
  T = x_BLD.shape[0] * x_BLD.shape[1]
  for dispatch, factor in (('dropless', 1.0), ('capacity', 0.5), ('capacity', 4.0)):
    groups = dict(groups=GROUPS, topk_groups=BEST, routed_scale=SCALE) if (
        router == 'sigmoid_topk') else {}
    cfg = moe.MoeConfig(E, F, K, router, S, dispatch, factor, aux_loss_coef=0.1,
                        z_loss_coef=0.01, **groups)
    with nnx.use_eager_sharding(False):
      layer = moe.MoeMlp(D, cfg, 0.5, nnx.Rngs(0))
    params = {k: np.asarray(v) for k, v in nnx.to_pure_dict(nnx.state(layer)).items()}
    y, aux, stats = layer(x_BLD, LocalOps())
    slots = moe.capacity(4, K, E, factor) if dispatch == 'capacity' else None
    y_np, balance, z, dropped = _numpy_layer(x_BLD.reshape(T, D), params, router, slots, 4)
    np.testing.assert_allclose(np.asarray(y).reshape(T, D), y_np, atol=1e-5, err_msg=dispatch)
    np.testing.assert_allclose(float(stats['balance']), balance, rtol=1e-5)
    np.testing.assert_allclose(float(stats['z']), z, rtol=1e-5)
    np.testing.assert_allclose(float(aux), 0.1 * balance + 0.01 * z, rtol=1e-5)
    np.testing.assert_allclose(float(stats['dropped']), dropped / (T * K), atol=1e-7)
    if factor == 0.5:  # 1 slot per expert for a sequence's 8 assignments: half are dropped.
      assert slots == 1 and dropped >= T * K - 3 * E * slots
    else:
      assert dropped == 0


def moe_config(mesh=(1, 1, 1), dispatch='dropless', mode='auto'):
  """A tiny MoE Llama on mesh DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]]."""
  config = tiny_config(mesh=mesh[:3], steps=2)
  config.mesh.context, config.mesh.stage, config.mesh.expert = (*mesh[3:], 1, 1, 1)[:3]
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


# The expert meshes: expert 4 x data 2, expert 2 x fsdp 2 x tensor 2, and expert 2 x
# stage 2 x data 2 (with 2 micro-batches: a pipeline computes the balance loss per micro-batch,
# the reference over the whole batch, so that layout is compared with its coefficient at 0).
EXPERT_MESHES = [(2, 1, 1, 1, 1, 4), (1, 2, 2, 1, 1, 2), (2, 1, 1, 1, 2, 2)]


def layout_config(mesh, dispatch, mode):
  config = moe_config(mesh, dispatch, mode)
  if config.mesh.stage > 1:
    config.train.microbatches = 2
    config.model.moe_aux_loss_coef = 0.0
  return config


@pytest.fixture(scope='module')
def references():
  """Single-device runs by (dispatch, whether the balance loss is on)."""
  runs = {}
  for dispatch in moe.DISPATCHES:
    for balance in (True, False):
      config = moe_config(dispatch=dispatch)
      config.model.moe_aux_loss_coef = 0.1 if balance else 0.0
      runs[dispatch, balance] = single_device_run(config, 2)
  return runs


@pytest.mark.slow
@pytest.mark.parametrize('dispatch', moe.DISPATCHES)
def test_model_matches_single_device(dispatch, references):
  """Both modes on the three expert meshes; dropless also on data x context in manual mode (the
  routing statistics averaged over the sequence's devices)."""
  layouts = [(mode, mesh) for mesh in EXPERT_MESHES for mode in ('auto', 'manual')]
  if dispatch == 'dropless':
    layouts.append(('manual', (4, 1, 1, 2)))
  for mode, mesh in layouts:
    config = layout_config(mesh, dispatch, mode)
    run = engine_run(config, mode, 2)
    assert_same_run(run, references[dispatch, config.model.moe_aux_loss_coef > 0])


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_sigmoid_group_routing_matches_single_device(mode):
  """DeepSeek-V3's routing (two groups, the best one, scaled weights) on expert 4 x data 2 and
  expert 2 x fsdp 2 x tensor 2: the same run as one device. Guards the router's expert
  dimension staying whole on every device (split over `expert` as the experts' weights are,
  each device would choose groups among its own experts only), and the experts' hidden
  dimension summed over `tensor` after auto mode's dropless exchange (its shard_map without
  that psum fails it)."""
  def sigmoid(config):
    config.model.moe_router, config.model.moe_groups = 'sigmoid_topk', GROUPS
    config.model.moe_topk_groups, config.model.moe_routed_scale = BEST, SCALE
    return config
  reference = single_device_run(sigmoid(moe_config()), 2)
  for mesh in EXPERT_MESHES[:2]:
    assert_same_run(engine_run(sigmoid(moe_config(mesh, mode=mode)), mode, 2), reference)


@pytest.mark.slow
def test_an_expert_gradient_averaged_over_the_expert_axis_is_caught(references, monkeypatch):
  """The parity check catches the expert-parallel gradient trap: an expert's weights differ
  across the expert axis, so a pmean over it mixes different experts' gradients."""
  original = manual_ops.average_over_batch

  def averaged_over_expert(grad, replicated_axes, scatter_factor, reduce_dtype=jnp.float32):
    if scatter_factor == 1:  # On data 2 x expert 4 only the experts are split (over expert).
      return original(grad, replicated_axes, scatter_factor, reduce_dtype)
    mixed = jax.lax.pcast(jax.lax.pmean(grad, 'expert'), 'expert', to='varying')
    return original(mixed, replicated_axes, scatter_factor // 4, reduce_dtype)

  monkeypatch.setattr(manual_ops, 'average_over_batch', averaged_over_expert)
  run = engine_run(moe_config(EXPERT_MESHES[0], 'dropless', 'manual'), 'manual', 2)
  reference = references['dropless', True]
  for path, expected in reference.first_gradients.items():
    scale = np.abs(expected).max()
    error = np.abs(run.first_gradients[path] - expected).max() / scale
    routed = any(name in path for name in ('w_gate_EDF', 'w_up_EDF', 'w_down_EFD'))
    assert error > 0.1 if routed else error < 1e-5, (path, error)  # Only the experts' are off.
  with pytest.raises(AssertionError):
    assert_same_run(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize('dispatch, mesh', [
    ('capacity', EXPERT_MESHES[0]), ('dropless', EXPERT_MESHES[0]),
    ('capacity', EXPERT_MESHES[2])])
def test_the_all_to_all_bytes_are_what_theory_says(dispatch, mesh):
  """Manual mode: each layer's exchange is 2 all-to-alls forward and 2 backward over `expert`
  (dropless: plus the expert ids, forward), bytes as the theory counts them (by hand on expert 4
  x data 2), and every other collective as the theory says too: FSDP and tensor's, and the
  pipeline's, where the router's loads ride with the micro-batches."""
  config = layout_config(mesh, dispatch, 'manual')
  train_setup, compiled = compiled_train_step(config, 'manual')
  table = collective_table(train_setup, compiled)
  theory = comm_theory.expected_bytes(train_setup, config.data.global_batch_size,
                                      config.data.seq_len)
  exchange = table[('all-to-all', ('expert',))]
  # 16 sequences over data 2 x expert 4: 2 per device, 32 tokens, 64 assignments.
  if mesh != EXPERT_MESHES[0]:
    assert exchange['bytes'] > 0
  elif dispatch == 'capacity':  # [E=4, B=2, C=ceil(16 * 2 / 4 * 0.5)=4, D=32] float32.
    assert exchange['bytes'] == 2 * 4 * 4 * 2 * 4 * 32 * 4
  else:  # 4 blocks of 32 * min(2, 1) rows, D=32 float32; ids [4, 32] int32 forward.
    assert exchange['bytes'] == 2 * (4 * 4 * 32 * 32 * 4 + 4 * 32 * 4)
  # Every other collective as the theory says (gradient norms' scalar psums aside).
  measured = {key: row['array_bytes'] for key, row in table.items() if row['array_bytes']}
  assert measured == theory


@pytest.mark.slow
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
    ('capacity', 'manual', (4, 1, 1, 2), "model.moe_dispatch='capacity' in manual mode with "
     'mesh.context=2 is not supported'),
    ('capacity', 'manual', (2, 2, 2), None),
    ('capacity', 'auto', (4, 1, 1, 2), None),
    ('dropless', 'auto', (2, 2, 1, 1, 2), None)])  # Pipeline stages: test_moe_stats.py.
def test_unsupported_layouts_are_refused(dispatch, mode, mesh, message):
  config = moe_config(mesh, dispatch, mode)
  config.train.microbatches = config.mesh.stage
  if message is None:
    validate(config, 8)
    return
  with pytest.raises(ConfigError, match=message):
    validate(config, 8)


@pytest.mark.slow
def test_the_expert_axis_splits_the_experts_and_the_batch():
  """mesh.expert splits the experts' weights (stacked layers lead) and never gathers them, keeps
  the router whole, and splits the batch like data; a dense model on it is refused. Layout only:
  nothing compiles (the all-to-all dispatch is tested with its code)."""
  dense = tiny_config(mesh=(2, 1, 1))
  dense.mesh.expert = 4
  with pytest.raises(ConfigError, match="mesh.expert=4 splits a mixture of experts, but model "
                     "'gpt' is dense"):
    validate(dense, 8)
  # mesh (data, fsdp, tensor) with expert = the other devices -> expected specs.
  for mesh, expert, gate_spec, down_spec, router_spec, batch in [
      ((2, 1, 1), 4, P(None, 'expert', None, None), P(None, 'expert', None, None),
       P(None, None, None),
       ('data', 'expert')),
      ((1, 2, 2), 2, P(None, 'expert', 'fsdp', 'tensor'), P(None, 'expert', 'tensor', 'fsdp'),
       P(None, 'fsdp', None), ('fsdp', 'expert'))]:
    config = moe_config(mesh)
    config.mesh.expert = expert
    validate(config, 8)
    setup = lay_out(config, 256)
    params = {p.path: p for p in setup.parameters()}
    assert params['blocks/moe/w_gate_EDF'].spec == params['blocks/moe/w_up_EDF'].spec == gate_spec
    down = params['blocks/moe/w_down_EFD']
    assert down.spec == down_spec
    assert down.shard_shape[:2] == (2, 4 // expert)  # Both layers; only this device's experts.
    assert params['blocks/moe/w_router_DE'].spec == router_spec  # Every expert's logits.
    assert setup.rules.gather_axes('experts') == ()  # Computed where stored, unlike FSDP.
    assert setup.rules.spec(('batch', None), activation=True) == P(batch, None)
    assert setup.rules.spec(('experts', 'expert_groups'), activation=True) == P(
        'expert', batch[0])


def test_the_emulated_ragged_exchange_follows_the_primitive():
  """tests/support/ragged_exchange.py on ragged_all_to_all's docstring example (2 devices)."""
  mesh = jax.make_mesh((2,), ('x',), devices=jax.devices()[:2])
  args = [np.array(a, np.int32) for a in (
      [[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1], [0, 1]], [[1, 2], [1, 1]],
      [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
  step = jax.jit(jax.shard_map(
      lambda *a: ragged_exchange.ragged_all_to_all(*(x[0] for x in a), axis_name='x')[None],
      mesh=mesh, in_specs=(P('x'),) * 6, out_specs=P('x')))
  put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P('x')))
  np.testing.assert_array_equal(np.asarray(step(*map(put, args))), [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_the_ragged_exchange_trains_like_one_device(mode, references, monkeypatch):
  """Dropless with the blocks sent by ragged_all_to_all (TPU's and GPU's exchange, auto mode's
  inside a shard_map; on CPU the test's emulation of the primitive): the single-device run,
  manual mode on expert 4 x data 2, auto mode on expert 2 x fsdp 2 x tensor 2 (the experts'
  hidden dimension split over tensor inside the shard_map). Receiver slots shifted by a few rows
  fail it."""
  monkeypatch.setattr(expert_exchange, 'exchange_kind', lambda setup: expert_exchange.RAGGED)
  traced = []
  monkeypatch.setattr(jax.lax, 'ragged_all_to_all',
                      lambda *a, **kw: traced.append(1) or ragged_exchange.ragged_all_to_all(
                          *a, **kw))
  mesh = EXPERT_MESHES[0 if mode == 'manual' else 1]
  assert_same_run(engine_run(layout_config(mesh, 'dropless', mode), mode, 2),
                  references['dropless', True])
  assert traced  # The step went through the ragged exchange.
  if mode == 'auto':
    return
  shifted = lambda v, out, i, s, o, r, **kw: ragged_exchange.ragged_all_to_all(
      v, out, i, s, (o + s.shape[0]) % out.shape[0], r, **kw)
  monkeypatch.setattr(jax.lax, 'ragged_all_to_all', shifted)
  with pytest.raises(AssertionError):
    assert_same_run(engine_run(layout_config(EXPERT_MESHES[0], 'dropless', 'manual'), 'manual',
                               2), references['dropless', True])


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_the_tpu_step_sends_only_the_rows_in_use(mode):
  """Compiled for TPU v5p (expert 4 x data 2), dropless moves its blocks by ragged-all-to-all,
  there and back (the gradient too), and no whole block by all-to-all, in both modes."""
  config = layout_config(EXPERT_MESHES[0], 'dropless', mode)
  setup = lay_out(config, 256, plan_lib.topology_devices('v5p:2x2x2'))
  hlo = parallel.build_steps(mode, setup).train.lower(
      setup.abstract_state(), setup.abstract_batch(16, 16)).compile().as_text()
  # The scanned layer's body, once: the rows there, the outputs back, and in the backward pass
  # their transposes (each row's expert follows from the counts, an int32 all-to-all).
  ragged = [line for line in hlo.splitlines() if 'ragged-all-to-all(' in line]
  assert len(ragged) == 4, ragged
  whole = [line for line in hlo.splitlines() if ' all-to-all(' in line and 's32[' not in
           line.split('all-to-all(')[0]]
  assert not whole, whole[:2]
