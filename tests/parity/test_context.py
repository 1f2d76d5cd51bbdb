"""Context (sequence) parallelism: sequences split over the `context` axis in both modes (ring
attention in manual mode) match the single-device run; the ring's permutes are what theory says."""

import math

import pytest

from engine.analysis import collectives, comm_theory
from engine.errors import ConfigError
from engine.validation import validate
from tests.support.helpers import (assert_same_run, compiled_run, compiled_train_step,
                                   engine_run,
                                   single_device_run, tiny_config)

STEPS = 3


def _config(mesh=(1, 1, 1, 1), model='gpt'):
  config = tiny_config(mesh=mesh[:3], steps=STEPS)
  config.mesh.context = mesh[3]
  config.model.name = model
  if model == 'llama':
    config.model.num_kv_heads = 2  # Grouped-query: 2 key / value heads for 4 query heads.
  return config


@pytest.fixture(scope='module')
def references():
  return {model: single_device_run(_config(model=model), STEPS) for model in ('gpt', 'llama')}


# gpt on context 8 in manual mode: compared in test_ring_moves_each_key_value_block..., which
# reads the ring from the same compiled step.
@pytest.mark.slow
@pytest.mark.parametrize('model, mesh, mode', [
    ('gpt', (1, 1, 1, 8), 'auto'),
    ('gpt', (2, 1, 1, 4), 'manual'), ('gpt', (2, 1, 1, 4), 'auto'),
    ('gpt', (4, 1, 1, 2), 'manual'),
    # Three axes at once: fsdp, tensor (grouped key / value heads split) and context.
    ('llama', (1, 2, 2, 2), 'manual'), ('llama', (1, 2, 2, 2), 'auto'),
    ('llama', (1, 1, 2, 4), 'manual'),
    # Key / value heads replicated (2 over tensor 4): each device passes only the one its query
    # head reads around the ring.
    ('llama', (1, 1, 4, 2), 'manual'),
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else v)
def test_matches_single_device(model, mesh, mode, references):
  assert_same_run(engine_run(_config(mesh, model), mode, STEPS), references[model])


@pytest.mark.slow
@pytest.mark.parametrize('model, mesh, kv_heads', [
    ('gpt', (1, 1, 1, 8), 4), ('gpt', (1, 1, 2, 4), 2),
    # Grouped-query, 8 query / 2 key-value heads: the ring moves the key / value heads (split:
    # 1 of 2 per device; replicated over tensor 4: the 1 its 2 query heads read), not 4 or 2
    # query heads' worth.
    ('llama', (1, 1, 2, 4), 1), ('llama', (1, 1, 4, 2), 1),
], ids=['gpt_context8', 'gpt_tensor2_context4', 'gqa_tensor2_context4', 'gqa_tensor4_context2'])
def test_ring_moves_each_key_value_block_context_minus_1_times_each_way(model, mesh, kv_heads,
                                                                        references):
  """Exact, two-sided byte counts: a ring that moved twice the bytes (two blocks per permute, or
  twice the permutes, or query heads in place of grouped key / value heads) or half (half
  blocks, or keys only) fails the equalities below. Context 8 also trains, from the same
  compiled step, and must match the single-device run."""
  config = _config(mesh, model)
  if model == 'llama':
    config.model.num_heads = 8  # Head size 4, as GPT's 4 heads of width 32 have 8.
  if mesh == (1, 1, 1, 8):
    run, train_setup, compiled = compiled_run(config, 'manual', STEPS)
    assert_same_run(run, references['gpt'])
  else:
    train_setup, compiled = compiled_train_step(config, 'manual')
  assert train_setup.options.remat == 'none'  # One forward pass: no recomputed permutes.
  found = collectives.count_collectives(compiled.as_text(), train_setup.mesh)
  table = collectives.summarize(found)
  context = mesh[3]
  layers = config.model.num_layers
  permutes = table[('collective-permute', ('context',))]
  # Per layer: keys and values, context - 1 ring steps, forward and backward.
  assert permutes['executions'] == layers * 2 * (context - 1) * 2
  # Every permute moves exactly one device's block of keys or of values, [B, L / C, its kv
  # heads, K] float32: no more (two blocks, a wider dtype), no less (a half block, a narrower
  # dtype).
  block_shape = (config.data.global_batch_size, config.data.seq_len // context, kv_heads,
                 config.model.embed_dim // config.model.num_heads)
  local_block = math.prod(block_shape) * 4
  ring = [c for c in found if c.kind == 'collective-permute']
  assert {(c.shapes, c.buffer_bytes) for c in ring} == {((block_shape,), (local_block,))}
  assert permutes['bytes'] == permutes['array_bytes'] == permutes['executions'] * local_block
  # The communication theory gives the same bytes, both ways, for every (kind, axes) the step
  # runs: the ring's permutes, the gradient all-reduce over `context` (the sequence's devices
  # are batch devices for the gradients) and, with tensor = 2, the Megatron all-reduces. Scalars
  # (loss, gradient norm) are all the theory leaves out: array_bytes excludes them.
  theory = comm_theory.expected_bytes(train_setup, config.data.global_batch_size,
                                      config.data.seq_len)
  measured = {key: row['array_bytes'] for key, row in table.items()}
  assert measured == theory
  assert theory[('collective-permute', ('context',))] == permutes['executions'] * local_block
  for key, row in table.items():
    assert 0 <= row['bytes'] - row['array_bytes'] < 64, (key, row)  # A few float32 scalars.


def test_sequences_must_split_into_two_chunks_per_device():
  config = _config((1, 1, 1, 8))
  config.data.seq_len = config.model.max_len = 24  # 2 * 8 = 16 does not divide it.
  with pytest.raises(ConfigError, match=r'data.seq_len=24 must be a multiple of '
                     r'2\*mesh.context=16'):
    validate(config, 8)
  config = _config((1, 1, 1, 8))
  config.parallelism.mode = 'manual'
  config.model.attention = 'dot_product_attention'
  with pytest.raises(ConfigError, match="ring attention computes its own blocks"):
    validate(config, 8)
