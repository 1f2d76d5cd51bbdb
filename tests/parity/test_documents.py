"""data.document_masking: windows packing several documents (engine/models/documents.py).

A packed row must give each document the logits and next-token losses it gets alone (unpacked,
positions from 0); the masked loss must be the global sum over the global count on every
layout (parity with one device, per-device counts unequal); every attention path must mask
alike; segment ids, positions and the loss mask must match a NumPy reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from engine import models, parallel
from engine.assemble import lay_out
from engine.models.attention import causal as attention
from engine.models.attention.spec import AttentionSpec
from engine.models.documents import CONTEXT_FLAG as CONTEXT
from engine.models.documents import INSIDE_FLAG as INSIDE
from engine.models.documents import segments_and_positions
from engine.models.ops import LocalOps
from engine.parallel import manual
from engine.parallel.steps import kept_tokens, next_token_loss, packed_documents
from tests.support.helpers import tiny_config

EOS = 0
VOCAB = 64


def _numpy_documents(row):
  """Segment ids, positions and kept predictions of one window, by a plain loop. A token may
  carry a conversation's flags: context (its prediction is not trained), or an end-of-text id
  inside a conversation (not ending it)."""
  segments, positions, segment, position, ends = [], [], 0, 0, []
  for token in row:
    segments.append(segment)
    positions.append(position)
    position += 1
    ends.append(token % CONTEXT == EOS)  # Context-flagged or not; never inside-flagged.
    if ends[-1]:
      segment, position = segment + 1, 0
  keep = [not ends[i] and row[i + 1] < CONTEXT for i in range(len(row) - 1)]
  return np.array(segments), np.array(positions), np.array(keep)


def _flag(tokens, rng):
  """Some tokens flagged as context (about a third), some ids inside-flagged as not ending
  their document (about a third of the end-of-text ids)."""
  context = rng.random(tokens.shape) < 1 / 3
  inside = (tokens == EOS) & (rng.random(tokens.shape) < 1 / 3)
  return tokens | np.where(context, CONTEXT, 0) | np.where(inside, INSIDE, 0)


def test_segments_positions_and_kept_predictions():
  row = np.array([[5, 6, 0, 7, 0, 0, 8, 9, 3]])
  segments, positions = segments_and_positions(jnp.asarray(row), EOS)
  # By hand: an end-of-text token closes its document; the next starts at position 0.
  np.testing.assert_array_equal(segments[0], [0, 0, 0, 1, 1, 2, 3, 3, 3])
  np.testing.assert_array_equal(positions[0], [0, 1, 2, 0, 1, 0, 0, 1, 2])
  _, keep = packed_documents(LocalOps(), jnp.asarray(row), EOS)
  np.testing.assert_array_equal(keep[0], [1, 1, 0, 1, 0, 0, 1, 1])
  rng = np.random.default_rng(0)
  rows = rng.integers(0, 4, (6, 40))  # Many boundaries, some adjacent.
  rows = np.concatenate([rows, _flag(rows, rng)])  # And a conversation's flags.
  assert (rows >= CONTEXT).any() and (rows % CONTEXT >= INSIDE).any()
  segments, positions = segments_and_positions(jnp.asarray(rows), EOS)
  _, keep = packed_documents(LocalOps(), jnp.asarray(rows), EOS)
  for i, row in enumerate(rows):
    want = _numpy_documents(row)
    for got, expected in zip((segments[i], positions[i], keep[i]), want):
      np.testing.assert_array_equal(np.asarray(got), expected)


def _model(name):
  config = tiny_config().model
  config.name, config.max_len = name, 32
  if name == 'llama':
    config.num_kv_heads = 2
  return models.build(config, VOCAB).create(nnx.Rngs(params=0))


# Two windows of 21 tokens (20 predictions), documents of different lengths; the last one of
# each window runs past its end.
DOCUMENTS = [[[3, 9, 4, 0], [7, 5, 6, 8, 2, 0], [11, 0], [4, 4, 9, 12, 13, 14, 15, 16, 17]],
             [[21, 22, 23, 24, 25, 26, 0], [30, 31, 32, 0], [40, 41, 42, 43, 44, 45, 46, 47, 48,
                                                           49]]]


@pytest.mark.parametrize('name', ['gpt', 'llama'])
def test_a_packed_window_is_its_documents_run_alone(name):
  model = _model(name)
  params, graphdef = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.graphdef(model)
  tokens = jnp.asarray([sum(docs, []) for docs in DOCUMENTS])
  assert tokens.shape == (2, 21)

  apply = lambda params, tokens, ops=LocalOps(): nnx.merge(graphdef, params)(tokens, ops)

  @jax.jit
  def packed_and_plain(params, tokens):
    ops, keep = packed_documents(LocalOps(), tokens, EOS)
    return apply(params, tokens[:, :-1], ops), apply(params, tokens[:, :-1]), keep

  logits, plain, keep = map(np.asarray, packed_and_plain(params, tokens))
  # Every document alone, in one batch: each row one document from position 0, padded at its
  # end (causal: the padding changes none of the document's own logits).
  docs = [doc for row in DOCUMENTS for doc in row]
  alone = np.asarray(jax.jit(apply)(params, jnp.asarray(
      [doc[:-1] + [1] * (20 - len(doc)) for doc in docs])))
  all_losses, targets, row, start = [], [], 0, 0
  for i, doc in enumerate(docs):
    if i == len(DOCUMENTS[0]):
      row, start = 1, 0
    span = slice(start, start + len(doc) - 1)
    np.testing.assert_allclose(logits[row, span], alone[i, :len(doc) - 1], atol=2e-5)
    losses = optax.softmax_cross_entropy_with_integer_labels(alone[i, :len(doc) - 1],
                                                             np.asarray(doc[1:]))
    all_losses.extend(np.asarray(losses))
    targets.extend((row, start + 1 + j) for j in range(len(doc) - 1))
    if start:  # Unmasked, a later document sees the earlier ones: the check can fail.
      assert np.abs(plain[row, span] - alone[i, :len(doc) - 1]).max() > 1e-3
    start += len(doc)
  # The masked loss: the mean of the documents' own predictions (none across a boundary).
  assert int(keep.sum()) == len(all_losses) == 2 * 20 - 5
  loss = jax.jit(lambda p, t: next_token_loss(p, graphdef, t, LocalOps(), with_aux=False,
                                              eos_id=EOS))(params, tokens)
  np.testing.assert_allclose(loss, np.mean(all_losses), rtol=1e-6)
  # Targets flagged as context (a conversation's prompt) leave the loss; the rest keep theirs.
  flagged = np.asarray(tokens).copy()
  context = np.random.default_rng(2).random(flagged.shape) < 0.4
  flagged[context] |= CONTEXT
  trained = [not context[target] for target in targets]
  assert 5 < sum(trained) < len(trained) - 5
  loss = jax.jit(lambda p, t: next_token_loss(p, graphdef, t, LocalOps(), with_aux=False,
                                              eos_id=EOS))(params, jnp.asarray(flagged))
  np.testing.assert_allclose(loss, np.mean(np.asarray(all_losses)[trained]), rtol=1e-6)


@pytest.mark.slow
def test_every_attention_path_masks_alike():
  """dot_product_attention and the splash kernel (Pallas interpret mode on CPU; 128 positions,
  one tile) against the einsum path, outputs and (splash: its custom backward) gradients;
  grouped keys and values (4 query heads, 2 kv heads)."""
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 128, 4, 8))
  k, v = (jax.random.normal(key, (2, 128, 2, 8)) for key in keys[1:3])
  tokens = jax.random.randint(keys[3], (2, 129), 0, 12)  # About one document end in 12.
  segments = segments_and_positions(tokens, EOS)[0][:, :-1]
  assert 5 < int(segments[:, -1].min())
  cotangent = jax.random.normal(jax.random.key(1), q.shape)

  def out_and_grads(implementation, segments):
    loss = lambda q, k, v: (attention.causal_attention(
        q, k, v, AttentionSpec(implementation), segments_BL=segments) * cotangent).sum()
    out = attention.causal_attention(q, k, v, AttentionSpec(implementation),
                                     segments_BL=segments)
    return out, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  einsum = jax.jit(lambda s: out_and_grads('einsum', s))(segments)
  unmasked = jax.jit(lambda: out_and_grads('einsum', None)[0])()
  assert np.abs(np.asarray(unmasked - einsum[0])).max() > 1e-2  # The mask matters.
  for implementation in ('dot_product_attention', 'splash'):
    other = jax.jit(lambda s, i=implementation: out_and_grads(i, s))(segments)
    for got, want in zip(jax.tree.leaves(other), jax.tree.leaves(einsum)):
      np.testing.assert_allclose(got, want, atol=2e-5, err_msg=implementation)


def _layout(mesh=(1, 1, 1, 1, 1), microbatches=1):
  """A tiny Llama (rotary positions inside the layers, grouped keys and values) with packed
  documents, laid out on `mesh` (data, fsdp, tensor, context, stage)."""
  config = tiny_config(mesh=mesh[:3])
  config.mesh.context, config.mesh.stage = mesh[3:]
  config.model.name, config.model.num_kv_heads = 'llama', 2
  config.data.global_batch_size, config.data.document_masking = 8, True
  config.train.microbatches = microbatches
  devices = jax.devices()[:int(np.prod(mesh))]
  return lay_out(config, VOCAB, devices, eos_id=EOS)


@pytest.fixture(scope='module')
def reference():
  """(params, tokens, loss and gradients on one device)."""
  setup = _layout()
  params = setup.init(0)[0]['params']
  # Row r ends a document at about one token in 2 + r (at least one): the rows that the
  # layouts put on different devices keep unequal counts, so a mean of per-device means
  # would differ from the global mean.
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, VOCAB, (8, 17))
  tokens[rng.random((8, 17)) < 1 / (2 + np.arange(8)[:, None])] = EOS
  tokens[:, 5] = EOS
  tokens = _flag(tokens, rng)  # The loss trains on some targets only, unequally per row.
  loss, grads = parallel.build_steps('auto', setup).gradients(params, tokens)
  return jax.device_get(params), tokens, float(loss), jax.device_get(grads)


@pytest.mark.slow
@pytest.mark.parametrize('mode, mesh, microbatches', [
    ('manual', (2, 2, 2, 1, 1), 2), ('auto', (2, 2, 2, 1, 1), 2),
    ('manual', (2, 1, 2, 2, 1), 1), ('auto', (2, 1, 2, 2, 1), 1),  # Ring attention / auto's.
    ('manual', (2, 1, 2, 1, 2), 2), ('auto', (2, 1, 2, 1, 2), 2),  # Pipelines.
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_a_train_step_matches_one_device(mode, mesh, microbatches, reference):
  params, tokens, want_loss, want_grads = reference
  setup = _layout(mesh, microbatches)
  params = jax.device_put(params, setup.state_shardings()['params'])
  loss, grads = parallel.build_steps(mode, setup).gradients(params, tokens)
  np.testing.assert_allclose(float(loss), want_loss, atol=1e-5)
  for got, want in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.slow
def test_a_mean_of_per_device_means_fails_the_check(reference, monkeypatch):
  """The bug the global count prevents: each device dividing by its own count."""
  params, tokens, want_loss, _ = reference

  def local_count(ops, tokens_BL1, eos_id, microbatches=1):
    keep_BL = ops.inputs_and_targets(kept_tokens(tokens_BL1, eos_id))[0]
    return keep_BL.sum(dtype=jnp.float32) / microbatches

  monkeypatch.setattr(manual, 'kept_count', local_count)
  setup = _layout((8, 1, 1, 1, 1))
  params = jax.device_put(params, setup.state_shardings()['params'])
  loss, _ = parallel.build_steps('manual', setup).gradients(params, tokens)
  # At initialisation every token's loss is near log(vocab), so the means differ little; still
  # 30x the parity check's tolerance.
  assert abs(float(loss) - want_loss) > 1e-4


@pytest.mark.slow
def test_the_splash_ring_masks_documents_like_one_device():
  """model.attention='splash', manual mode, data 4 x context 2: 512 positions in zigzag chunks
  of 128 (device 0 holds chunks 0 and 3, device 1 chunks 1 and 2), one layer of grouped-query
  Llama. Document ends at 50, 200, 300 and 450 (rows 0-3: boundaries inside chunks; the late
  chunks 2 and 3 start mid-document; queries after 450 see no key of chunk 0, 1 or 2: fully
  masked block rows), random ones in rows 4-7. Loss and gradients match the single-device
  einsum run; the kernel's blocks (Pallas interpret mode) differ from it by about 1e-6."""
  def layout(mesh, implementation):
    config = tiny_config(mesh=mesh[:3])
    config.mesh.context = mesh[3]
    config.model.name, config.model.num_kv_heads, config.model.num_layers = 'llama', 2, 1
    config.model.attention, config.parallelism.mode = implementation, 'manual'
    config.data.seq_len = config.model.max_len = 512
    config.data.global_batch_size, config.data.document_masking = 8, True
    return lay_out(config, VOCAB, jax.devices()[:int(np.prod(mesh))], eos_id=EOS)

  rng = np.random.default_rng(2)
  tokens = rng.integers(1, VOCAB, (8, 513))
  tokens[:4, [50, 200, 300, 450]] = EOS
  tokens[4:][rng.random((4, 513)) < 1 / 40] = EOS
  one = layout((1, 1, 1, 1), 'einsum')
  params = one.init(0)[0]['params']
  want_loss, want_grads = jax.device_get(parallel.build_steps('auto', one).gradients(
      params, tokens))
  ring = layout((4, 1, 1, 2), 'splash')
  loss, grads = parallel.build_steps('manual', ring).gradients(
      jax.device_put(params, ring.state_shardings()['params']), tokens)
  np.testing.assert_allclose(float(loss), float(want_loss), atol=1e-5)
  for got, want in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()))
