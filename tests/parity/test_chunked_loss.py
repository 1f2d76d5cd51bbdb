"""model.loss_chunks: the head and cross-entropy applied to strided slices of the positions in
turn (engine/models/chunked_loss.py).

- The chunked loss and its gradients equal NumPy's cross-entropy of the whole logits, with and
  without packed documents' kept predictions; slicing the targets in blocks while the features
  are strided (the planted bug) fails that.
- Both modes equal the unchunked single-device run on data x fsdp x tensor (manual mode's
  cross-entropy over a vocabulary split over tensor, and its head split by vocabulary over the
  fsdp group, each device keeping its own rows' losses: the first device's kept everywhere,
  planted, fail),
  with a sequence split over context, and through a 1F1B pipeline whose head is split over the
  stages.
- The compiled step no longer holds the whole batch's float32 logits: its temporaries fall by
  more than 1.5 times their size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.models import chunked_loss
from engine.models.ops import LocalOps
from engine.parallel import manual_ops
from tests.parity.test_llama import llama_config
from tests.support.helpers import (assert_same_run, compiled_train_step, engine_run,
                                   single_device_run)

B, L, D, V = 3, 12, 5, 11


def _numpy_loss(features_BLD, head_DV, targets_BL, keep_BL, count):
  logits = features_BLD.astype(np.float64) @ head_DV
  logits -= logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  losses = -np.take_along_axis(log_probs, targets_BL[..., None], -1)[..., 0]
  return losses.mean() if keep_BL is None else np.where(keep_BL, losses, 0).sum() / count


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(B, L, D)).astype(np.float32),
          rng.normal(size=(D, V)).astype(np.float32),
          rng.integers(0, V, (B, L)).astype(np.int32), rng.random((B, L)) > 0.3)


def _chunked(features, head, targets, keep, count, chunks):
  return chunked_loss.chunked_cross_entropy(lambda x: x @ head, features, targets, keep, count,
                                            LocalOps(), chunks)


@pytest.mark.parametrize('documents', [False, True], ids=['mean', 'kept'])
@pytest.mark.parametrize('chunks', [2, 3, 12])
def test_the_chunked_loss_and_its_gradients_follow_numpy(chunks, documents):
  features, head, targets, keep = _problem()
  keep, count = (keep, 17.0) if documents else (None, None)
  loss = _chunked(features, head, targets, keep, count, chunks)
  np.testing.assert_allclose(loss, _numpy_loss(features, head, targets, keep, count), rtol=1e-6)

  whole = lambda f, h: LocalOps().cross_entropy(f @ h, targets, keep, count)
  chunked = lambda f, h: chunked_loss.chunked_cross_entropy(
      lambda x: x @ h, f, targets, keep, count, LocalOps(), chunks)
  for expected, actual in zip(jax.grad(whole, (0, 1))(features, head),
                              jax.grad(chunked, (0, 1))(features, head)):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-7)


def test_targets_sliced_unlike_the_features_are_caught(monkeypatch):
  features, head, targets, _ = _problem()
  original = chunked_loss.chunk_major

  def blocks_for_targets(x, chunks):  # Targets in blocks of L / C, features strided.
    if x.ndim == 2:
      return jnp.moveaxis(x.reshape(x.shape[0], chunks, -1), 1, 0)
    return original(x, chunks)

  monkeypatch.setattr(chunked_loss, 'chunk_major', blocks_for_targets)
  loss = _chunked(features, head, targets, None, None, 3)
  assert abs(float(loss) - _numpy_loss(features, head, targets, None, None)) > 1e-2


@pytest.fixture(scope='module')
def reference():
  return single_device_run(llama_config(), 2)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
@pytest.mark.parametrize('mesh, chunks', [((2, 2, 2, 1), 4), ((2, 1, 2, 2), 2)],
                         ids=['data2_fsdp2_tensor2', 'data2_tensor2_context2'])
def test_both_modes_equal_the_unchunked_single_device_run(mesh, chunks, mode, reference):
  config = llama_config(mesh[:3])
  config.mesh.context, config.model.loss_chunks = mesh[3], chunks
  assert_same_run(engine_run(config, mode, 2), reference)


@pytest.mark.slow
def test_losses_of_the_wrong_rows_fail_the_parity(monkeypatch, reference):
  """Over fsdp, manual mode's chunks gather the group's features and split the head by
  vocabulary (ManualOps.chunk_loss_sum; the fsdp mesh above passes through it); each device
  keeps its own rows' losses. Every device keeping the first device's (the planted bug) fails."""
  monkeypatch.setattr(manual_ops.ManualOps, '_own_rows', lambda self, group, rows: (
      jax.lax.dynamic_slice_in_dim(group, 0 * self.shard_index(self.head_axes), rows, axis=0)))
  config = llama_config((2, 2, 2))
  config.model.loss_chunks = 4
  with pytest.raises(AssertionError):
    assert_same_run(engine_run(config, 'manual', 2), reference)


@pytest.mark.slow
def test_a_1f1b_pipeline_with_its_head_split_equals_the_single_device_run(reference):
  config = llama_config((4, 1, 1))
  config.mesh.stage, config.model.loss_chunks = 2, 4
  config.train.microbatches, config.train.pipeline_schedule = 2, '1f1b'
  assert_same_run(engine_run(config, 'manual', 2), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_the_step_no_longer_holds_the_whole_logits(mode):
  """A vocabulary of 8192 makes the batch's float32 logits (16 x 16 x 8192 x 4 bytes = 8 MiB)
  and what the backward pass keeps of them most of the step's temporaries (19.5 MiB on
  XLA:CPU); in 8 chunks one chunk's remain (8.6 MiB). Chunks not rematerialised (the scan
  keeping each chunk's residuals: 16.6 MiB) fail this."""
  temporaries = {}
  for chunks in (1, 8):
    config = llama_config()
    config.model.loss_chunks, config.model.vocab_size = chunks, 8192
    _, compiled = compiled_train_step(config, mode, vocab_size=8192, devices=jax.devices()[:1])
    temporaries[chunks] = compiled.memory_analysis().temp_size_in_bytes
  logits_bytes = 16 * 16 * 8192 * 4
  assert temporaries[8] < temporaries[1] - logits_bytes, temporaries
