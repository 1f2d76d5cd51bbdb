"""The zero-bubble pipeline schedule (train.pipeline_schedule='zb_h1'): both modes against the
single-device run on stage 2 and stage 4 meshes with data, fsdp and tensor, 4 and 8
micro-batches, a remat policy; packed documents and a mixture of experts; planted bugs in the
weight pass fail the check; its collectives are 1F1B's; the bubble it implies."""

import numpy as np
import pytest

from engine.parallel.pipeline import zero_bubble
from engine.parallel.pipeline.gpipe import bubble_fraction
from tests.parity.test_documents import EOS, VOCAB
from tests.parity.test_moe import moe_config
from tests.parity.test_pipeline import _config
from tests.parity.test_pipeline_1f1b import (_assert_same_gradients, _document_tokens,
                                             _documents_config, _gradients, _one_device_gradients,
                                             _tokens)
from tests.support.helpers import (assert_same_run, collective_table, compiled_train_step,
                                   engine_run, single_device_run)

STEPS = 2


def _zero_bubble(mesh, model='gpt', layers=4, microbatches=4, batch=16):
  config = _config(mesh, model, layers, microbatches)
  config.train.pipeline_schedule = 'zb_h1'
  config.data.global_batch_size = batch or config.data.global_batch_size
  return config


@pytest.mark.slow
@pytest.mark.parametrize('mode, model, layers, mesh, microbatches', [
    ('manual', 'gpt', 4, (2, 1, 1, 1, 4), 8), ('auto', 'llama', 2, (1, 2, 2, 1, 2), 4)],
    ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_matches_single_device(mode, model, layers, mesh, microbatches):
  """Loss and gradient norm of every step, every first-step gradient, every parameter after
  the steps: data 2 x stage 4 (manual), fsdp 2 x tensor 2 x stage 2 (auto)."""
  config = _zero_bubble(mesh, model, layers, microbatches, batch=None)
  reference = single_device_run(_config(model=model, layers=layers), STEPS)
  assert_same_run(engine_run(config, mode, STEPS), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode, model, layers, mesh, microbatches, remat', [
    ('manual', 'gpt', 4, (4, 1, 1, 1, 2), 4, 'none'),
    ('manual', 'llama', 2, (1, 2, 2, 1, 2), 8, 'dots_saveable'),
    ('auto', 'gpt', 4, (1, 2, 1, 1, 4), 8, 'none'),
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_gradients_match_one_device(mode, model, layers, mesh, microbatches, remat):
  """Loss and every gradient: stage 2 with data 4, and with fsdp 2 x tensor 2 under a remat
  policy (the single device runs without); stage 4 with fsdp 2 and 8 micro-batches (auto: the
  ring of S slots between the two passes reused, which a slot index that does not wrap
  around, min(m, S - 1) in SplitBackward.input_pass, fails)."""
  reference = _one_device_gradients(model, layers)
  config = _zero_bubble(mesh, model, layers, microbatches)
  config.model.remat = remat
  _assert_same_gradients(_gradients(config, mode, _tokens(), reference[0]), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_packed_documents_match_one_device(mode):
  tokens = _document_tokens()
  reference = _gradients(_documents_config((1, 1, 1, 1, 1)), 'auto', tokens, vocab=VOCAB,
                         eos_id=EOS)
  config = _documents_config((2, 1, 1, 1, 2), 'zb_h1', 4 if mode == 'manual' else 2)
  _assert_same_gradients(_gradients(config, mode, tokens, reference[0], VOCAB, EOS), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_a_mixture_of_experts_with_its_balance_loss_matches_1f1b(mode):
  """The experts' weights are not projections: the input pass takes their gradients; the
  router's and the shared expert's are (1F1B, itself checked against GPipe, the reference).
  Guards the input pass's gradients of the parameters outside the projections in each mode's
  lanes (SplitBackward.input_pass dropping the experts' weights' gradients fails both)."""
  config = moe_config((2, 1, 1, 1, 2), mode=mode)
  config.model.num_layers = 2
  config.train.microbatches = 4 if mode == 'manual' else 2
  config.train.pipeline_schedule = '1f1b'
  tokens = np.random.default_rng(0).integers(0, 256, (config.data.global_batch_size,
                                                      config.data.seq_len + 1))
  one_f_one_b = _gradients(config, mode, tokens)
  config.train.pipeline_schedule = 'zb_h1'
  _assert_same_gradients(_gradients(config, mode, tokens, one_f_one_b[0]), one_f_one_b)


def _skip_weights(self, m):
  return lambda s, params, stash, d_stage, ring: d_stage


def _weights_of_the_next_microbatch(self, m, right=zero_bubble.SplitBackward.weight_pass):
  return right(self, (m + 1) % self.ticks.order.M)


@pytest.mark.slow
@pytest.mark.parametrize('planted', [_skip_weights, _weights_of_the_next_microbatch],
                         ids=['no_weight_pass', 'wrong_microbatch'])
def test_a_wrong_weight_pass_fails_the_check(planted, monkeypatch):
  """The planted bugs: the weight pass skipped, or run on another micro-batch's saved
  projections (the right one passes in test_gradients_match_one_device's manual stage 2)."""
  reference = _one_device_gradients('gpt', 4)
  monkeypatch.setattr(zero_bubble.SplitBackward, 'weight_pass', planted)
  with pytest.raises(AssertionError, match='Not equal to tolerance'):
    _assert_same_gradients(_gradients(_zero_bubble((4, 1, 1, 1, 2)), 'manual', _tokens(),
                                      reference[0]), reference)


def _collectives_and_temporaries(schedule):
  config = _config((2, 1, 2, 1, 2), 'llama', 4, 4)
  config.train.pipeline_schedule = schedule
  setup, compiled = compiled_train_step(config, 'manual')
  table = collective_table(setup, compiled)
  return ({key: row['array_bytes'] for key, row in table.items()},
          compiled.memory_analysis().temp_size_in_bytes)


@pytest.mark.slow
def test_the_collectives_are_1f1bs_and_the_ring_costs_memory():
  """data 2 x tensor 2 x stage 2: the weight pass communicates nothing (its products are
  local; the tensor all-reduces stay three per layer and tick), and the ring of the
  projections' inputs and cotangents adds to 1F1B's temporaries."""
  zero_bubble, zb_temporaries = _collectives_and_temporaries('zb_h1')
  one_f_one_b, temporaries = _collectives_and_temporaries('1f1b')
  assert zero_bubble == one_f_one_b
  assert zb_temporaries > temporaries


def test_the_implied_bubble_is_three_quarters_of_1f1bs_at_most():
  """(S - 1) 3 F of 3 F (M + S - 1) + M F against 1F1B's (S - 1) / (M + S - 1)."""
  assert bubble_fraction(4, 8, schedule='zb_h1') == pytest.approx(9 / 41)
  for stages, microbatches in ((2, 4), (4, 8), (16, 32)):
    ratio = (bubble_fraction(stages, microbatches, schedule='zb_h1') /
             bubble_fraction(stages, microbatches, schedule='1f1b'))
    assert 0.75 < ratio < 1, (stages, microbatches, ratio)
