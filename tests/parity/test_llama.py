"""The Llama-style model in both modes on every mesh, grouped-query attention, and its parts.

Parity as in test_manual_parity.py (tolerance: tests/support/helpers.py): losses and gradient
norms of every step, every gradient of step 1, every parameter after the last step, against the
model's own single-device run (engine.analysis.reference).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from engine.models.llama import model as llama
from engine.models.attention.causal import causal_attention
from engine.models.attention.spec import AttentionSpec
from engine.assemble import assemble
from engine.parallel import manual_ops
from tests.support.helpers import (assert_same_run, compiled_train_step, engine_run,
                                   single_device_run, tiny_config)

STEPS = 2
MESHES = [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (2, 4, 1), (1, 2, 4)]


def llama_config(mesh=(1, 1, 1), kv_heads=8, steps=STEPS):
  config = tiny_config(mesh=mesh, steps=steps)
  config.model.name = 'llama'
  config.model.num_heads = 8  # Head size 4: tensor=8 splits the query heads too.
  config.model.num_kv_heads = kv_heads
  config.model.tie_embeddings = False
  return config


@pytest.fixture(scope='module')
def reference():
  return single_device_run(llama_config(), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
@pytest.mark.parametrize('mesh', MESHES, ids=lambda m: 'x'.join(map(str, m)))
def test_matches_single_device(mesh, mode, reference):
  assert_same_run(engine_run(llama_config(mesh), mode, STEPS), reference)


@pytest.mark.slow
def test_a_lookup_whose_rows_go_to_the_wrong_device_fails_the_parity(monkeypatch, reference):
  """Manual FSDP looks tokens up on each device's columns of the embedding table and sends the
  rows home (ManualOps.embed_lookup; the fsdp meshes above pass through it): rows looked up for
  another device's tokens fail."""
  original = manual_ops.ManualOps._vocab_lookup
  monkeypatch.setattr(manual_ops.ManualOps, '_vocab_lookup', lambda self, table, tokens: (
      original(self, table, jnp.flip(tokens, 0))))
  with pytest.raises(AssertionError):
    assert_same_run(engine_run(llama_config((2, 4, 1)), 'manual', STEPS), reference)


def test_manual_fsdp_never_forms_the_whole_embedding_table(monkeypatch):
  """Looked up on its columns, the table is neither gathered nor given a whole gradient: the
  compiled step's temporaries are more than 1.25 float32 tables smaller than with the table
  gathered like the other weights (1.6 tables: 5.0 -> 3.4 MiB at a vocabulary of 8192)."""
  vocab, config = 8192, llama_config((1, 8, 1))
  table_bytes = vocab * config.model.embed_dim * 4
  temporaries = {}
  for columns in (True, False):
    if not columns:
      monkeypatch.setattr(manual_ops, 'columns_lookup_axes', lambda setup: ())
    _, compiled = compiled_train_step(config, 'manual', vocab_size=vocab)
    temporaries[columns] = compiled.memory_analysis().temp_size_in_bytes
  assert temporaries[True] < temporaries[False] - 1.25 * table_bytes, temporaries


@pytest.fixture(scope='module')
def gqa_reference():
  return single_device_run(llama_config(kv_heads=2), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
@pytest.mark.parametrize('mesh', [(2, 1, 4), (1, 4, 2)], ids=['kv_replicated', 'kv_split'])
def test_grouped_query_attention(mesh, mode, gqa_reference):
  """2 key/value heads for 8 query heads: over tensor=4 they cannot split and are replicated
  (each device takes its query heads' share), over tensor=2 they split like the query heads."""
  config = llama_config(mesh, kv_heads=2)
  specs = {p.path: p.spec for p in assemble(config).setup.parameters()}
  kv_split = mesh[2] == 2
  assert specs['blocks/w_k_DNK'] == P(None, 'fsdp' if mesh[1] > 1 else None,
                                      'tensor' if kv_split else None, None)
  assert specs['blocks/w_q_DHK'][2] == 'tensor'
  assert_same_run(engine_run(config, mode, STEPS), gqa_reference)


@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_dot_product_attention_and_logit_scaling_match_the_einsum_path(mode, reference):
  """jax.nn.dot_product_attention (cuDNN's flash attention on GPUs), with 1/sqrt(head_dim) on
  the logits, computes what the einsum path with scaled queries does (the reference)."""
  config = llama_config((2, 2, 2))
  config.model.attention = 'dot_product_attention'
  config.model.attention_scale_on = 'logits'
  assert_same_run(engine_run(config, mode, STEPS), reference)


def test_rotary_rotates_pairs_by_position():
  """Rotate-half convention: dimension i pairs with i + K/2, angle position * base^(-i/(K/2)).
  Relative positions: the product of a rotated query and key depends only on their distance."""
  x = jax.random.normal(jax.random.key(0), (1, 6, 1, 8))
  rotated = llama.rotary(x, jnp.arange(6), llama.Rope(10_000.0))
  np.testing.assert_allclose(rotated[:, 0], x[:, 0], atol=1e-6)  # Position 0: no rotation.
  angle = 1.0  # Position 1, pair 0: base^0.
  expected = x[0, 1, 0, 0] * np.cos(angle) - x[0, 1, 0, 4] * np.sin(angle)
  np.testing.assert_allclose(rotated[0, 1, 0, 0], expected, rtol=1e-5)
  q, k = x[:, :1], x[:, 1:2]  # One query and one key vector, moved to positions p and p + 2.
  rope = llama.Rope(1e4)
  dots = [jnp.sum(llama.rotary(q, jnp.array([p]), rope) * llama.rotary(k, jnp.array([p + 2]), rope))
          for p in range(3)]
  np.testing.assert_allclose(dots, dots[0], rtol=1e-5)


@pytest.mark.parametrize('implementation', ['einsum', 'dot_product_attention'])
def test_grouped_attention_equals_numpy_with_repeated_heads(implementation):
  """Keys and values of 2 heads for 8 query heads, grouped inside the attention (no repeat):
  query head h reads key / value head h // 4, checked against NumPy on repeated heads."""
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((2, 6, heads, 4)).astype(np.float32) for heads in (8, 2, 2))
  got = causal_attention(q, k, v, AttentionSpec(implementation))
  k8, v8 = np.repeat(k, 4, axis=2), np.repeat(v, 4, axis=2)
  logits = np.einsum('bqhk,bshk->bhqs', q / 2.0, k8)  # 1 / sqrt(head size 4).
  logits = np.where(np.tril(np.ones((6, 6), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(got, np.einsum('bhqs,bshk->bqhk', probs, v8), rtol=1e-5, atol=1e-6)
