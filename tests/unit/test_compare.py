"""The compare report and the communication theory behind it."""

import json
import os

import jax
import pytest

from engine import parallel
from engine.analysis import collectives, comm_theory
from engine.analysis.compare import report as compare_report
from engine.analysis.compare import comparison
from engine.parallel import manual_ops
from engine.parallel.pipeline.gpipe import bubble_fraction
from engine.assemble import lay_out
from tests.support.helpers import tiny_config


def _counts_from_compiled(config, mode):
  train_setup = lay_out(config, 256)
  batch = train_setup.abstract_batch(16, 16)
  text = parallel.build_steps(mode, train_setup).train.lower(
      train_setup.abstract_state(), batch).compile().as_text()
  return collectives.summarize(collectives.count_collectives(text, train_setup.mesh))


@pytest.mark.slow
def test_report_agrees_counts_collectives_and_writes_plots(tmp_path):
  config = tiny_config(mesh=(2, 2, 2), steps=3)
  report = comparison.compare(config, str(tmp_path), ['auto', 'manual'], steps=2, warmup=1)
  assert 'auto: AGREES' in report['verdict'] and 'manual: AGREES' in report['verdict']
  assert len(report['losses']['manual']) == 3 and len(report['reference_losses']) == 3
  assert report['speed']['ratio']['median'] > 0
  rows = report['communication']
  assert rows
  for mode in ('auto', 'manual'):
    counted = _counts_from_compiled(config, mode)
    for row in rows:
      key = (row['kind'], tuple(row['axes'].split(',')) if row['axes'] != '-' else ())
      expected = counted.get(key, {'executions': 0, 'array_bytes': 0})
      assert row[mode]['executions'] == expected['executions'], (mode, key)
      assert row[mode]['bytes'] == expected['array_bytes'], (mode, key)
  # The manual layout moves exactly what the theory says over data and tensor.
  by_key = {(r['kind'], r['axes']): r for r in rows}
  assert by_key[('all-reduce', 'data')]['manual']['ratio'] == pytest.approx(1.0)
  assert by_key[('all-reduce', 'tensor')]['manual']['ratio'] == pytest.approx(1.0, abs=1e-3)
  for name in ('report.md', 'report.json', 'loss.png', 'step_time.png', 'communication.png'):
    assert os.path.getsize(tmp_path / name) > 0
  assert open(tmp_path / 'loss.png', 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
  text = open(tmp_path / 'report.md').read()
  assert '## Communication per step and device' in text and 'AGREES' in text
  # The verdict on the collectives comes first, and on 2x2x2 explains every row off its theory.
  assert text.index('## Collectives off their theory') < text.index('## Numerics')
  assert 'UNEXPLAINED' not in text
  assert all(flag['reason'] for flag in report['off_theory'])
  assert json.load(open(tmp_path / 'report.json'))['mesh'] == {'data': 2, 'fsdp': 2, 'tensor': 2,
                                                               'context': 1, 'stage': 1,
                                                               'expert': 1}


@pytest.mark.slow
def test_summed_instead_of_averaged_gradients_are_reported_as_diverging(tmp_path, monkeypatch):
  def summed(grad, replicated_axes, *_):  # The bug: psum where pmean belongs.
    return jax.lax.psum(grad, replicated_axes) if replicated_axes else grad

  monkeypatch.setattr(manual_ops, 'average_over_batch', summed)
  report = comparison.compare(tiny_config(mesh=(8, 1, 1), steps=3), str(tmp_path),
                              ['auto', 'manual'], steps=1, warmup=1)
  assert 'auto: AGREES' in report['verdict']
  assert 'manual: DIVERGES' in report['verdict']
  divergence = report['numerics']['manual']['first_divergence']
  assert divergence['step'] == 1  # The first update is already wrong.
  assert 'DIVERGES' in open(tmp_path / 'report.md').read()


# Hand-worked theory for the tiny GPT: vocab 256, embed 32, 2 layers, MLP 64, 16 positions;
# batch 16 x length 16. Floats per part: token embedding 256*32 = 8192, positions 16*32 = 512,
# final norm 2*32 = 64; per layer: norms 4*32 = 128, qkv 3*32*32 = 3072, attention out 32*32 =
# 1024, MLP up 32*64 = 2048, its bias 64, MLP down 64*32 = 2048, its bias 32 (8416 per layer).
TOTAL_FLOATS = 8192 + 512 + 64 + 2 * 8416  # 25600
TOP_SHARDED_FLOATS = 8192 + 512  # Embeddings: gathered once, before the layers.
LAYER_MATRIX_FLOATS = 2 * (3072 + 1024 + 2048 + 2048)  # Gathered again in the backward.
LAYER_BIAS_FLOATS = 2 * 32  # The MLP-down bias: its gradient needs no bias, so gathered once.
LAYER_SHARDED_FLOATS = LAYER_MATRIX_FLOATS + LAYER_BIAS_FLOATS
FSDP_SHARDED_FLOATS = TOP_SHARDED_FLOATS + LAYER_SHARDED_FLOATS  # 25152: every embed dimension
REPLICATED_FLOATS = TOTAL_FLOATS - FSDP_SHARDED_FLOATS  # 448: norms and the MLP-up bias


def _theory(mesh, **model):
  config = tiny_config(mesh=mesh)
  config.model.update(model)
  return comm_theory.expected_bytes(lay_out(config, 256), 16, 16)


def test_theory_data_parallel_is_one_all_reduce_of_all_gradients():
  assert _theory((8, 1, 1)) == {('all-reduce', ('data',)): 4 * TOTAL_FLOATS}


def test_theory_fsdp_gathers_layers_twice_and_scatters_once():
  assert _theory((1, 8, 1)) == {
      ('all-gather', ('fsdp',)): 4 * (TOP_SHARDED_FLOATS + LAYER_BIAS_FLOATS
                                      + 2 * LAYER_MATRIX_FLOATS),
      ('reduce-scatter', ('fsdp',)): 4 * FSDP_SHARDED_FLOATS // 8,
      ('all-reduce', ('fsdp',)): 4 * REPLICATED_FLOATS,
  }


def test_theory_tensor_parallel_is_two_activation_all_reduces_per_block_each_way():
  activation = 16 * 16 * 32 * 4  # [batch, length, embed] floats; batch not split over tensor.
  blocks = 4 * 2 * activation  # 2 forward + 2 backward, 2 layers.
  vocab = 2 * activation + 3 * 16 * 16 * 4  # Embedding / logits input, and the loss terms.
  assert _theory((1, 1, 8), num_heads=8) == {('all-reduce', ('tensor',)): blocks + vocab}


def test_theory_2x2x2_combines_the_three():
  theory = _theory((2, 2, 2))
  # Data: fsdp-sharded gradients (their shard) over data; replicated ones over data and fsdp.
  assert ('all-reduce', ('data',)) in theory and ('all-reduce', ('data', 'fsdp')) in theory
  # Batch 16 over data*fsdp = 4 rows per device: activations of 4*16*32 floats.
  activation = 4 * 16 * 32 * 4
  assert theory[('all-reduce', ('tensor',))] == 8 * activation + 2 * activation + 3 * 4 * 16 * 4


@pytest.mark.slow
def test_grouped_query_ring_moves_kv_heads_and_the_report_says_how_much_less():
  """Ring attention passes Llama's N key / value heads: H / N times fewer permuted bytes than a
  model with a key / value head per query head, and the report's note quotes that cut."""
  ring_bytes, setups = {}, {}
  for kv_heads in (1, 4):
    config = tiny_config(mesh=(4, 1, 1))
    config.mesh.context = 2
    config.model.name, config.model.num_kv_heads = 'llama', kv_heads
    setups[kv_heads] = setup = lay_out(config, 256)
    theory = comm_theory.expected_bytes(setup, 16, 16)
    ring_bytes[kv_heads] = sum(b for (kind, axes), b in theory.items()
                               if kind == 'collective-permute' and 'context' in axes)
  assert ring_bytes[1] > 0 and ring_bytes[4] == 4 * ring_bytes[1]
  assert setups[1].attention_heads() == {'query': 4, 'kv': 1}
  assert setups[4].attention_heads() == {'query': 4, 'kv': 4}
  rows = [{'kind': 'collective-permute', 'axes': 'context', 'theory_bytes': ring_bytes[1]},
          {'kind': 'all-reduce', 'axes': 'data,context', 'theory_bytes': 10 ** 6}]
  report = {'mesh': {'context': 2}, 'communication': rows, 'attention_heads': {'query': 4,
                                                                                 'kv': 1}}
  note = ' '.join(compare_report._grouped_query_note(report))
  assert f'{ring_bytes[1] / 2**20:.2f} MiB' in note and f'{ring_bytes[4] / 2**20:.2f}' in note
  assert '(4x less)' in note
  report['attention_heads'] = {'query': 4, 'kv': 4}
  assert compare_report._grouped_query_note(report) == []


@pytest.mark.parametrize('schedule, repeats, name', [
    (None, 1, 'GPipe'), (None, 2, 'circular (2 layer groups per stage)'), ('1f1b', 1, '1F1B'),
    ('interleaved_1f1b', 2, 'interleaved 1F1B (2 layer groups per stage)'),
    ('zb_h1', 1, 'zero-bubble (ZB-H1)')])
def test_the_pipeline_note_names_the_schedule_and_its_bubble(schedule, repeats, name):
  """A report names the schedule the run used and that schedule's bubble (a report written
  before the schedule was recorded: GPipe or circular, as those runs were)."""
  report = {'mesh': {'stage': 4}, 'microbatches': 8, 'pipeline_repeats': repeats}
  if schedule:
    report['pipeline_schedule'] = schedule
  note = ' '.join(compare_report._schedule_note(report))
  bubble = bubble_fraction(4, 8, repeats, schedule or '')
  assert f'on the {name} schedule' in note and f'**{bubble:.3f}**' in note
