"""The 1F1B pipeline schedules (train.pipeline_schedule='1f1b' and 'interleaved_1f1b'): both
modes against the single-device run on stage 2 and stage 4 meshes with data, fsdp and tensor;
packed documents and a mixture of experts; a stash one slot short fails the check; the manual
step's collectives as the theory says; its memory bounded as the micro-batches grow; bad
schedules refused."""

import jax
import numpy as np
import pytest

from engine import parallel
from engine.analysis import comm_theory
from engine.errors import ConfigError
from engine.parallel.pipeline import one_f_one_b as pipeline_1f1b
from engine.parallel.pipeline import stage_lanes
from engine.validation import validate
from tests.parity.test_documents import EOS, VOCAB
from tests.parity.test_moe import moe_config
from tests.parity.test_pipeline import _config
from tests.support.helpers import (assert_same_run, collective_table, compiled_train_step,
                                   engine_run, single_device_run)

STEPS = 2


def _one_f_one_b(mesh, model='gpt', layers=2, microbatches=2):
  config = _config(mesh, model, layers, microbatches)
  config.train.pipeline_schedule = '1f1b'
  return config


def _interleaved(mesh, model='gpt', layers=4, microbatches=4, repeats=2):
  config = _config(mesh, model, layers, microbatches, repeats)
  config.train.pipeline_schedule = 'interleaved_1f1b'
  return config


@pytest.fixture(scope='module')
def references():
  return {(model, layers): single_device_run(_config(model=model, layers=layers), STEPS)
          for model, layers in (('gpt', 4), ('llama', 2))}


@pytest.mark.slow
@pytest.mark.parametrize('mode, model, layers, mesh, microbatches', [
    ('manual', 'gpt', 4, (2, 1, 1, 1, 4), 8), ('auto', 'gpt', 4, (2, 1, 1, 1, 4), 4),
    ('manual', 'gpt', 4, (4, 1, 1, 1, 2), 4),
    ('manual', 'llama', 2, (1, 2, 2, 1, 2), 4), ('auto', 'llama', 2, (1, 2, 2, 1, 2), 4),
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_matches_single_device(mode, model, layers, mesh, microbatches, references):
  """Loss and gradient norm of every step, every first-step gradient, every parameter after
  the steps."""
  config = _one_f_one_b(mesh, model, layers, microbatches)
  assert_same_run(engine_run(config, mode, STEPS), references[(model, layers)])


@pytest.mark.slow
@pytest.mark.parametrize('mode, mesh, microbatches', [
    ('manual', (4, 1, 1, 1, 2), 4), ('auto', (2, 2, 1, 1, 2), 2)],
    ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_interleaved_matches_single_device(mode, mesh, microbatches, references):
  """Two chunks of one layer per stage; with 4 micro-batches on 2 stages, two groups of them;
  auto mode with FSDP and the head on the last stage (elsewhere auto mode splits it)."""
  config = _interleaved(mesh, microbatches=microbatches)
  config.train.pipeline_head = 'split' if mode == 'manual' else 'last_stage'
  assert_same_run(engine_run(config, mode, STEPS), references[('gpt', 4)])


def _gradients(config, mode, tokens, params=None, vocab=256, eos_id=None):
  from engine.assemble import lay_out
  devices = jax.devices()[:int(np.prod([config.mesh[a] for a in (
      'data', 'fsdp', 'tensor', 'context', 'stage', 'expert')]))]
  setup = lay_out(config, vocab, devices, eos_id=eos_id)
  if params is None:
    params = setup.init(0)[0]['params']
  # One stack's [L, ...] as a grouped one's [R, L / R, ...] (pipeline_repeats R), or as it is.
  shapes = jax.eval_shape(lambda: setup.init(0)[0]['params'])
  params = jax.tree.map(lambda a, shape: np.reshape(a, shape.shape), jax.device_get(params),
                        shapes)
  params = jax.device_put(params, setup.state_shardings()['params'])
  loss, grads = parallel.build_steps(mode, setup).gradients(params, tokens)
  return params, float(loss), jax.device_get(grads)


def _tokens():
  return np.random.default_rng(0).integers(0, 256, (16, 17))


_ONE_DEVICE = {}


def _one_device_gradients(model, layers):
  """(parameters, loss, gradients) of one device on _tokens(), computed once per module."""
  if (model, layers) not in _ONE_DEVICE:
    _ONE_DEVICE[model, layers] = _gradients(_config(model=model, layers=layers), 'auto',
                                            _tokens())
  return _ONE_DEVICE[model, layers]


def _assert_same_gradients(got, want):
  (_, got_loss, got_grads), (_, want_loss, want_grads) = got, want
  np.testing.assert_allclose(got_loss, want_loss, atol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    # A grouped stack's [R, L / R, ...] against one stack's [L, ...]: the same layers in order.
    np.testing.assert_allclose(np.reshape(g, w.shape), w, atol=1e-5 * max(1.0, np.abs(w).max()))


def _documents_config(mesh, schedule='', microbatches=1):
  config = _config(mesh, 'llama', 2, microbatches)
  config.data.global_batch_size, config.data.document_masking = 8, True
  config.train.pipeline_schedule = schedule
  return config


def _document_tokens():
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, VOCAB, (8, 17))
  tokens[rng.random((8, 17)) < 1 / (2 + np.arange(8)[:, None])] = EOS
  return tokens


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_packed_documents_match_one_device(mode):
  """Manual mode: 4 micro-batches of one row per device, the head split over the 2 stages by
  positions (a document's boundary may fall on the cut); auto: 2 of 4 rows, split by rows."""
  tokens = _document_tokens()
  reference = _gradients(_documents_config((1, 1, 1, 1, 1)), 'auto', tokens, vocab=VOCAB,
                         eos_id=EOS)
  config = _documents_config((2, 1, 1, 1, 2), '1f1b', 4 if mode == 'manual' else 2)
  got = _gradients(config, mode, tokens, reference[0], VOCAB, EOS)
  _assert_same_gradients(got, reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['manual', 'auto'])
def test_a_mixture_of_experts_with_its_balance_loss_matches_gpipe(mode):
  """The balance loss is per micro-batch in any pipeline (the single-device run has it over
  the whole batch): the GPipe schedule of the same layout, itself checked against one device
  in test_moe.py, is the reference; the auxiliary loss is on. Guards the carry's extras (the
  layers' balance terms) moving with x between stages: auto mode's own (StackedLanes.to_next
  leaving them on their stage fails it), manual mode's ppermute."""
  config = moe_config((2, 1, 1, 1, 2), mode=mode)
  config.model.num_layers = 2
  config.train.microbatches = 4 if mode == 'manual' else 2
  tokens = np.random.default_rng(0).integers(0, 256, (config.data.global_batch_size,
                                                      config.data.seq_len + 1))
  gpipe = _gradients(config, mode, tokens)
  config.train.pipeline_schedule = '1f1b'
  _assert_same_gradients(_gradients(config, mode, tokens, gpipe[0]), gpipe)


@pytest.mark.slow
@pytest.mark.parametrize('mode, model, layers, mesh, microbatches', [
    ('manual', 'gpt', 8, (2, 1, 1, 1, 4), 4), ('auto', 'gpt', 8, (2, 1, 1, 1, 4), 4),
    ('manual', 'llama', 4, (1, 2, 2, 1, 2), 4), ('auto', 'llama', 4, (1, 2, 2, 1, 2), 2),
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_interleaved_gradients_match_one_device_with_fsdp_and_tensor(mode, model, layers, mesh,
                                                                      microbatches):
  """Loss and every gradient: stage 4 with data (two chunks of one layer each), and fsdp 2 x
  tensor 2 x stage 2 (Llama)."""
  config = _interleaved(mesh, model, layers, microbatches)
  config.data.global_batch_size = 16
  reference = _one_device_gradients(model, layers)
  _assert_same_gradients(_gradients(config, mode, _tokens(), reference[0]), reference)


@pytest.mark.slow
@pytest.mark.parametrize('mode, schedule, remat', [
    ('manual', '1f1b', 'full'), ('auto', 'interleaved_1f1b', 'dots_saveable')])
def test_remat_policies_compose_with_the_schedules(mode, schedule, remat):
  """A stage's remat policy applies inside the backward tick's recomputed forward pass: the
  gradients stay the single device's (data 2 x stage 2 Llama; the single device runs without
  remat). Gradient accumulation has no separate form here: with stages the micro-batches are
  the pipeline's."""
  config = (_one_f_one_b((2, 1, 1, 1, 2), 'llama', 4, 4) if schedule == '1f1b' else
            _interleaved((2, 1, 1, 1, 2), 'llama', 4, 2))
  config.model.remat, config.data.global_batch_size = remat, 16
  reference = _one_device_gradients('llama', 4)
  _assert_same_gradients(_gradients(config, mode, _tokens(), reference[0]), reference)


@pytest.mark.slow
@pytest.mark.parametrize('schedule', ['1f1b', 'interleaved_1f1b'])
def test_a_stash_one_slot_short_fails_the_check(schedule, monkeypatch):
  """The planted bug: a stage overwrites an item's input before its backward pass. With the
  right stash the same layouts pass (test_matches_single_device's manual data 2 x stage 4 with
  8 micro-batches, and test_interleaved_matches_single_device's manual one)."""
  config = (_one_f_one_b((2, 1, 1, 1, 4), layers=4, microbatches=8) if schedule == '1f1b' else
            _interleaved((4, 1, 1, 1, 2), microbatches=4))
  config.data.global_batch_size = 16
  reference = _one_device_gradients('gpt', 4)
  monkeypatch.setattr(pipeline_1f1b, 'stash_slots',
                      lambda stages, microbatches, chunks: 2 * chunks * stages - 2)
  with pytest.raises(AssertionError, match='Not equal to tolerance'):
    _assert_same_gradients(_gradients(config, 'manual', _tokens(), reference[0]), reference)


@pytest.mark.slow
def test_a_head_that_reads_the_wrong_rows_fails_the_check(monkeypatch):
  """The planted bug: every stage takes the first rows' tokens, not its own, for the slice of
  the last stage's output it was dealt (the right rows pass in test_matches_single_device's
  manual fsdp x tensor x stage Llama, whose head is split)."""
  config = _one_f_one_b((1, 1, 1, 1, 2), layers=4, microbatches=2)
  config.data.global_batch_size = 16
  reference = _one_device_gradients('gpt', 4)
  monkeypatch.setattr(stage_lanes.Lanes, 'own_tokens', lambda self, tokens, axis: (
      jax.lax.slice_in_dim(tokens, 0, (tokens.shape[axis] - axis) // self.stages + axis,
                           axis=axis)))
  with pytest.raises(AssertionError, match='Not equal to tolerance'):
    _assert_same_gradients(_gradients(config, 'manual', _tokens(), reference[0]), reference)


def _step_flops(head, vocab):
  config = _one_f_one_b((2, 1, 1, 1, 4), layers=4, microbatches=4)
  config.train.pipeline_head = head
  config.model.vocab_size = vocab
  config.data.global_batch_size = 32  # 4 rows per device and micro-batch: one per stage.
  setup, compiled = compiled_train_step(config, 'manual', vocab)
  return setup, config, compiled.cost_analysis()['flops']


@pytest.mark.slow
def test_the_split_head_cuts_a_devices_head_flops_by_the_stage_count():
  """data 2 x stage 4, a head of 4096 words: split over the stages, each device's step runs
  3 / 4 of the head's forward and backward FLOPs (6 x rows x length x embed x vocab) fewer
  than on the last stage, where every stage runs it on its own output."""
  setup, config, split = _step_flops('split', 4096)
  last = _step_flops('last_stage', 4096)[2]
  rows = config.data.global_batch_size // 2  # This device's, over the micro-batches.
  head = 6 * rows * config.data.seq_len * config.model.embed_dim * 4096
  assert 0.95 < (last - split) / (head * 3 / 4) < 1.1, (last, split, head)


def _temporaries(schedule, microbatches):
  config = _config((2, 1, 1, 1, 4), layers=4, microbatches=microbatches)
  config.train.pipeline_schedule = schedule
  config.model.embed_dim, config.data.seq_len, config.model.max_len = 64, 64, 64
  config.data.global_batch_size = 4 * microbatches  # The micro-batch keeps its size.
  return compiled_train_step(config, 'manual')[1].memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_manual_memory_stays_bounded_as_the_microbatches_grow():
  """data 2 x stage 4, from 4 to 8 micro-batches of the same size: 1F1B's temporaries grow by
  less than half of GPipe's growth (the stash still fills from 4 to its 2 x 4 - 1 items)."""
  growth = {schedule: _temporaries(schedule, 8) - _temporaries(schedule, 4)
            for schedule in ('gpipe', '1f1b')}
  assert 0 < growth['1f1b'] < growth['gpipe'] / 2, growth


@pytest.mark.slow
@pytest.mark.parametrize('mesh, model, schedule', [
    ((2, 1, 1, 1, 4), 'gpt', '1f1b'), ((2, 1, 2, 1, 2), 'llama', '1f1b'),
    ((4, 1, 1, 1, 2), 'gpt', 'interleaved_1f1b')],
    ids=['data2_stage4', 'data2_tensor2_stage2', 'data4_stage2_interleaved2'])
def test_manual_collectives_match_the_theory(mesh, model, schedule):
  """GPipe's permutes; the gradients of the weights outside the stack summed over the stages
  instead of GPipe's broadcasts; three tensor all-reduces per layer and tick (the backward tick
  runs the forward pass again). (Under FSDP a stage gathers its layers' weights in every tick
  that runs them, which XLA:CPU partly merges: not compared.)"""
  config = (_one_f_one_b(mesh, model, layers=4, microbatches=4) if schedule == '1f1b' else
            _interleaved(mesh))
  setup, compiled = compiled_train_step(config, 'manual')
  table = collective_table(setup, compiled)
  theory = comm_theory.expected_bytes(setup, config.data.global_batch_size, config.data.seq_len)
  measured = {key: row['array_bytes'] for key, row in table.items() if row['array_bytes']}
  assert measured.keys() == theory.keys()
  for key, value in theory.items():
    assert 0 <= measured[key] - value < 64, (key, measured[key], value)


@pytest.mark.parametrize('schedule, mesh, repeats, message', [
    ('zigzag', (4, 1, 1, 1, 2), 1, "train.pipeline_schedule='zigzag' is unknown"),
    ('1f1b', (8, 1, 1, 1, 1), 1, "'1f1b' needs pipeline stages, but mesh.stage=1"),
    ('circular', (4, 1, 1, 1, 2), 1, "'circular' needs train.pipeline_repeats > 1"),
    ('1f1b', (4, 1, 1, 1, 2), 2, "'1f1b' runs one group of layers per stage, but "
                                 'train.pipeline_repeats=2; set it to 1, or choose '
                                 'interleaved_1f1b'),
    ('interleaved_1f1b', (4, 1, 1, 1, 2), 1, "'interleaved_1f1b' needs train.pipeline_repeats "
                                             '> 1 .* or choose 1f1b'),
    ('interleaved_1f1b', (2, 1, 1, 1, 4), 2, 'groups of mesh.stage=4, but train.microbatches=6; '
                                             'make it a multiple of 4'),
    ('zb_h1', (8, 1, 1, 1, 1), 1, "'zb_h1' needs pipeline stages, but mesh.stage=1"),
    ('zb_h1', (4, 1, 1, 1, 2), 2, "'zb_h1' runs one group of layers per stage, but "
                                  'train.pipeline_repeats=2; set it to 1, or choose '
                                  'interleaved_1f1b'),
])
def test_bad_schedules_are_refused(schedule, mesh, repeats, message):
  config = _config(mesh, layers=8, microbatches=6 if mesh[4] == 4 else 2, repeats=repeats)
  config.train.pipeline_schedule = schedule
  with pytest.raises(ConfigError, match=message):
    validate(config, 8)


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def test_fewer_microbatches_than_stages_are_refused(schedule):
  config = _one_f_one_b((4, 1, 1, 1, 2), microbatches=1)
  config.train.pipeline_schedule = schedule
  with pytest.raises(ConfigError, match='train.microbatches=1 is fewer than mesh.stage=2'):
    validate(config, 8)


def test_the_stash_holds_at_most_two_stages_minus_one_inputs():
  assert [pipeline_1f1b.stash_slots(4, m) for m in (2, 4, 7, 8, 32)] == [2, 4, 7, 7, 7]
  assert pipeline_1f1b.ticks(4, 8) == 8 + 2 * 4 - 2


def test_the_head_splits_by_rows_then_positions():
  """4 stages: rows that divide (per stage still over auto mode's batch ways), else positions
  of a whole sequence, else the last stage; 'last_stage' always the last stage."""
  x = lambda rows, length=16: np.zeros((rows, length, 8), np.float32)
  tokens = lambda rows, length=16: np.zeros((rows, length + 1), np.int32)
  manual = stage_lanes.Lanes('stage', 4)
  auto = stage_lanes.StackedLanes(4, None, None, None, row_ways=2)
  in_context = stage_lanes.StackedLanes(4, None, None, None, row_ways=1, positions_split=False)
  axis = pipeline_1f1b.head_axis
  assert axis(x(8), tokens(8), manual, 'split') == 0
  assert axis((x(2), {'load': np.zeros(3)}), tokens(2), manual, 'split') == 1
  assert axis(x(8), tokens(8), auto, 'split') == 0 and axis(x(4), tokens(4), auto, 'split') == 1
  assert axis(x(2, 6), tokens(2, 6), manual, 'split') is None
  assert axis(x(2, 4), tokens(2, 16), manual, 'split') is None  # A context split of positions.
  assert axis(x(2), tokens(2), in_context, 'split') is None
  assert axis(x(8), tokens(8), manual, 'last_stage') is None
