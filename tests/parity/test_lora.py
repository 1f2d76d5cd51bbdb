"""LoRA (engine/models/llama/lora.py): the adapted projections are the merged weights W + s A B (a
NumPy merge as the reference), only the adapters train (the base unchanged bit for bit, no optimizer
state for it), a train step in either mode on every layout matches one device, and a manual
data-parallel step reduces the adapters' gradients only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine import models, parallel
from engine.assemble import lay_out
from engine.models.llama import lora
from engine.models.documents import CONTEXT_FLAG
from engine.models.ops import LocalOps
from tests.parity.test_moe import moe_config
from tests.support.helpers import assert_resumes_exactly, collective_table, tiny_config

VOCAB = 64
RANK, ALPHA = 4, 8.0


def _config(mesh=(1, 1, 1, 1, 1), microbatches=1, lora_rank=RANK):
  config = tiny_config(mesh=mesh[:3])
  config.mesh.context, config.mesh.stage = mesh[3:]
  config.model.name, config.model.num_kv_heads = 'llama', 2
  config.model.lora_rank, config.model.lora_alpha = lora_rank, ALPHA
  config.data.global_batch_size = 8
  config.train.microbatches = microbatches
  return config


def _with_random_b(params, seed=1):
  """The adapters' B away from their zero start, so that every adapter has a gradient."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda keys, x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)
      if str(keys[-1].key).endswith('_b') and lora.is_adapter(str(keys[-1].key)) else x, params)


def test_adapted_projections_are_the_merged_weights():
  adapted = models.build(_config().model, VOCAB).create(nnx.Rngs(params=0))
  graphdef, params = nnx.split(adapted, nnx.Param)
  params = _with_random_b(nnx.to_pure_dict(params))
  plain_config = _config(lora_rank=0).model
  plain_graphdef, _ = nnx.split(models.build(plain_config, VOCAB).create(nnx.Rngs(params=0)),
                                nnx.Param)
  merged = {k: v for k, v in params.items() if k != 'blocks'}
  blocks = params['blocks']
  merged['blocks'] = {k: v for k, v in blocks.items() if not lora.is_adapter(k)}
  for name, (weight, in_dims, short) in lora.TARGETS.items():
    a, b, w = (np.asarray(blocks[f'lora_{short}_a'], np.float64),
               np.asarray(blocks[f'lora_{short}_b'], np.float64), np.asarray(blocks[weight]))
    layers, rank = a.shape[0], a.shape[-1]
    # Per layer: W + (alpha / rank) * A @ B over the flattened input and output dimensions.
    product = np.stack([(a[i].reshape(-1, rank) @ b[i].reshape(rank, -1)).reshape(w.shape[1:])
                        for i in range(layers)])
    merged['blocks'][weight] = (w + ALPHA / RANK * product).astype(np.float32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 16)))
  got = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, LocalOps()))(params)
  want = jax.jit(lambda p: nnx.merge(plain_graphdef, p)(tokens, LocalOps()))(merged)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  # Zero B: the adapted model is the base model.
  zero_b = jax.tree_util.tree_map_with_path(
      lambda keys, x: jnp.zeros_like(x) if str(keys[-1].key).endswith('_b') and
      lora.is_adapter(str(keys[-1].key)) else x, params)
  base_only = {**merged, 'blocks': {k: v for k, v in blocks.items() if not lora.is_adapter(k)}}
  np.testing.assert_array_equal(
      jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, LocalOps()))(zero_b),
      jax.jit(lambda p: nnx.merge(plain_graphdef, p)(tokens, LocalOps()))(base_only))


@pytest.fixture(scope='module')
def reference():
  """(state, tokens, the state after one auto train step on one device)."""
  setup = lay_out(_config(), VOCAB, jax.devices()[:1])
  state, _ = setup.init(0)
  state = {**state, 'params': _with_random_b(state['params'])}
  tokens = np.random.default_rng(3).integers(0, VOCAB, (8, 17))
  after, metrics = parallel.build_steps('auto', setup).train(jax.device_get(state), tokens)
  return jax.device_get(state), tokens, jax.device_get(after), float(metrics['loss'])


def _flat(tree):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_only_the_adapters_train_and_hold_optimizer_state(reference):
  before, _, after, _ = reference
  old, new = _flat(before['params']), _flat(after['params'])
  changed = {k for k in old if not np.array_equal(old[k], new[k])}
  assert changed == {k for k in old if lora.PREFIX in k.rsplit("'", 2)[-2]}, sorted(changed)
  moments = [x for x in jax.tree.leaves(after['opt_state']) if np.ndim(x)]
  adapters = [v for k, v in old.items() if k in changed]
  assert sorted(m.size for m in moments) == sorted(2 * [a.size for a in adapters])


@pytest.mark.slow
@pytest.mark.parametrize('mode, mesh, microbatches', [
    ('manual', (2, 2, 2, 1, 1), 2), ('auto', (2, 2, 2, 1, 1), 2),
    ('manual', (1, 4, 2, 1, 1), 1),  # FSDP gathers the adapters' embed dimension too.
    ('manual', (2, 1, 2, 2, 1), 1), ('auto', (2, 1, 2, 2, 1), 1),  # Ring attention / auto's.
    ('manual', (2, 1, 2, 1, 2), 2), ('auto', (2, 1, 2, 1, 2), 2),  # Pipelines.
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_a_train_step_matches_one_device(mode, mesh, microbatches, reference):
  before, tokens, want, want_loss = reference
  setup = lay_out(_config(mesh, microbatches), VOCAB, jax.devices()[:int(np.prod(mesh))])
  state = jax.device_put(before, setup.state_shardings())
  after, metrics = parallel.build_steps(mode, setup).train(state, tokens)
  np.testing.assert_allclose(float(metrics['loss']), want_loss, atol=1e-5)
  got, expected = _flat(jax.device_get(after['params'])), _flat(want['params'])
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_manual_data_parallel_reduces_only_the_adapters_gradients():
  config = _config((8, 1, 1, 1, 1))
  setup = lay_out(config, VOCAB, jax.devices())
  batch = setup.abstract_batch(8, config.data.seq_len)
  compiled = parallel.build_steps('manual', setup).train.lower(
      setup.abstract_state(), batch).compile()
  reduced = sum(row['bytes'] for (kind, _), row in collective_table(setup, compiled).items()
                if kind == 'all-reduce')
  params = jax.tree_util.tree_leaves_with_path(setup.abstract_params)
  adapters = sum(x.size * 4 for k, x in params if lora.is_adapter(str(k[-1].key)))
  everything = sum(x.size * 4 for _, x in params)
  # The adapters' gradients and a few scalars (the loss, the norm); not the frozen weights'.
  assert adapters <= reduced < adapters + 1024 < everything, (reduced, adapters, everything)


@pytest.mark.slow
def test_a_lora_run_resumes_exactly_in_the_other_mode(tmp_path):
  def config(steps, mode='manual'):
    c = _config((2, 2, 2, 1, 1))
    c.parallelism.mode = mode
    c.train.num_steps, c.optim.decay_steps = steps, 8
    c.train.checkpoint_every, c.train.async_checkpoints = 2, False
    c.data.source, c.data.synthetic_tokens = 'synthetic', 20_000
    return c

  # The adapters and their masked optimizer state saved in manual mode, restored in auto mode.
  assert_resumes_exactly(config, tmp_path, {'mode': 'auto'})


def _moe_config(mesh=(1, 1, 1, 1, 1, 1)):
  """A tiny mixture of experts with LoRA on its attention projections, trained on packed
  conversations (context-flagged tokens, document masking)."""
  config = moe_config(mesh, 'dropless')
  config.model.lora_rank, config.model.lora_alpha = RANK, ALPHA
  config.model.lora_targets = 'q_proj,k_proj,v_proj,o_proj'
  config.data.global_batch_size, config.data.document_masking = 8, True
  return config


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_experts_with_adapters_on_packed_conversations_match_one_device(mode):
  """The expert layout (expert 4 x data 2) with both new pieces at once: the adapters train and
  the loss counts only the trained (unflagged) targets, as on one device."""
  rng = np.random.default_rng(5)
  tokens = rng.integers(1, VOCAB, (8, 17))
  tokens[rng.random(tokens.shape) < 0.15] = 0  # Document ends (the end-of-text id 0).
  tokens |= np.where(rng.random(tokens.shape) < 0.4, CONTEXT_FLAG, 0)
  one = lay_out(_moe_config(), VOCAB, jax.devices()[:1], eos_id=0)
  state, _ = one.init(0)
  state = jax.device_get({**state, 'params': _with_random_b(state['params'])})
  want, want_metrics = parallel.build_steps('auto', one).train(state, tokens)
  setup = lay_out(_moe_config((2, 1, 1, 1, 1, 4)), VOCAB, jax.devices(), eos_id=0)
  after, metrics = parallel.build_steps(mode, setup).train(
      jax.device_put(state, setup.state_shardings()), tokens)
  np.testing.assert_allclose(float(metrics['loss']), float(want_metrics['loss']), atol=1e-5)
  got, expected = _flat(jax.device_get(after['params'])), _flat(jax.device_get(want['params']))
  moved = 0
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, atol=1e-5, err_msg=key)
    moved += not np.array_equal(value, _flat(state['params'])[key])
  assert moved == 8  # The four projections' A and B, and nothing else.
