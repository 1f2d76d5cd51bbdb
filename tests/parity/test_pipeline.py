"""Pipeline parallelism: stacked layers split over `stage`, micro-batches on the GPipe and the
circular schedules in both modes, against the single-device run; the manual schedule's permutes;
memory per stage."""

import os
import subprocess
import sys

import pytest

from engine.analysis import comm_theory
from engine.analysis.benchmark import fit_bubble
from engine.errors import ConfigError
from engine.validation import validate
from engine.models.layers import LAYERS, REPEATS
from engine.parallel.pipeline.gpipe import bubble_fraction
from tests.support.helpers import (assert_same_run, collective_table, compiled_run,
                                   compiled_train_step, engine_run, single_device_run, tiny_config)

STEPS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(mesh=(1, 1, 1, 1, 1), model='gpt', layers=2, microbatches=1, repeats=1):
  config = tiny_config(mesh=mesh[:3], steps=STEPS)
  config.mesh.context, config.mesh.stage = mesh[3:]
  config.model.name = model
  config.model.num_layers = layers
  config.train.microbatches = microbatches
  config.train.pipeline_repeats = repeats
  if model == 'llama':
    config.model.num_kv_heads = 2
  return config


@pytest.fixture(scope='module')
def references():
  return {(model, layers): single_device_run(_config(model=model, layers=layers), STEPS)
          for model, layers in (('gpt', 2), ('gpt', 4), ('llama', 2))}


# Manual mode on data 2 x stage 4 and on the circular layout below: compared in
# test_manual_schedule_permutes_and_parameter_memory, which reads its permutes from the same
# compiled step.
@pytest.mark.slow
@pytest.mark.parametrize('model, layers, mesh, microbatches, repeats, mode', [
    ('gpt', 2, (4, 1, 1, 1, 2), 2, 1, 'manual'), ('gpt', 2, (4, 1, 1, 1, 2), 2, 1, 'auto'),
    ('gpt', 4, (2, 1, 1, 1, 4), 4, 1, 'auto'),
    # Three axes at once: fsdp x tensor x stage, and tensor x context x stage.
    ('llama', 2, (1, 2, 2, 1, 2), 4, 1, 'manual'), ('llama', 2, (1, 2, 2, 1, 2), 4, 1, 'auto'),
    ('gpt', 2, (1, 1, 2, 2, 2), 2, 1, 'manual'), ('gpt', 2, (1, 1, 2, 2, 2), 2, 1, 'auto'),
    # Circular: 2 groups of 2 stages; with more micro-batches than stages, each waits on stage 0
    # for its second round.
    ('gpt', 4, (4, 1, 1, 1, 2), 4, 2, 'auto'),
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_matches_single_device(model, layers, mesh, microbatches, repeats, mode, references):
  run = engine_run(_config(mesh, model, layers, microbatches, repeats), mode, STEPS)
  assert_same_run(run, references[(model, layers)])


# data 2 x stage 4 and the circular layout also train, from the same compiled step, and must
# match the single-device run (their manual-mode parity check).
TRAINED = (((2, 1, 1, 1, 4), 1), ((4, 1, 1, 1, 2), 2))


@pytest.mark.slow
@pytest.mark.parametrize('mesh, repeats', [((4, 1, 1, 1, 2), 1), ((2, 1, 1, 1, 4), 1),
                                           ((1, 2, 1, 1, 4), 1), ((4, 1, 1, 1, 2), 2)],
                         ids=['data4_stage2', 'data2_stage4', 'fsdp2_stage4',
                              'data4_stage2_circular2'])
def test_manual_schedule_permutes_and_parameter_memory(mesh, repeats, references):
  microbatches, stages = 4, mesh[4]
  config = _config(mesh, layers=4, microbatches=microbatches, repeats=repeats)
  if (mesh, repeats) in TRAINED:
    run, train_setup, compiled = compiled_run(config, 'manual', STEPS)
    assert_same_run(run, references[('gpt', 4)])
  else:
    train_setup, compiled = compiled_train_step(config, 'manual')
  table = collective_table(train_setup, compiled)
  permutes = table[('collective-permute', ('stage',))]
  # repeats x microbatches + stages - 2 shifts forward, as many backward, of one micro-batch.
  assert permutes['executions'] == 2 * (repeats * microbatches + stages - 2)
  local_batch = config.data.global_batch_size // (mesh[0] * mesh[1])
  micro = local_batch // microbatches * config.data.seq_len * config.model.embed_dim * 4
  assert permutes['array_bytes'] == permutes['executions'] * micro
  theory = comm_theory.expected_bytes(train_setup, config.data.global_batch_size,
                                      config.data.seq_len)
  assert theory[('collective-permute', ('stage',))] == permutes['array_bytes']
  # Every collective as the theory says: gradients synchronised once per step, not once per
  # pipeline iteration (scalars, a few bytes, aside).
  measured = {key: row['array_bytes'] for key, row in table.items() if row['array_bytes']}
  assert measured.keys() == theory.keys()
  for key, value in theory.items():
    assert 0 <= measured[key] - value < 64, (key, measured[key], value)
  # Each stage stores 1 / stages of the stacked layers (circular: of every group).
  stacked = [p for p in train_setup.parameters() if LAYERS in p.logical_axes]
  assert stacked
  for p in stacked:
    if repeats == 1:
      assert p.logical_axes[0] == LAYERS and p.shard_shape[0] == 4 // stages, p.path
    else:
      assert p.logical_axes[:2] == (REPEATS, LAYERS), p.path
      assert p.shard_shape[:2] == (repeats, 4 // (stages * repeats)), p.path
  assert bubble_fraction(stages, microbatches, repeats) == (
      (stages - 1) / (repeats * microbatches + stages - 1))


def test_stage_counts_are_checked():
  config = _config((1, 1, 1, 1, 8), layers=4, microbatches=8)
  with pytest.raises(ConfigError, match='model.num_layers=4 does not split into mesh.stage=8'):
    validate(config, 8)
  config = _config((4, 1, 1, 1, 2), layers=2, microbatches=1)
  with pytest.raises(ConfigError, match='train.microbatches=1 is fewer than mesh.stage=2'):
    validate(config, 8)
  config = _config((4, 1, 1, 1, 2), layers=2, microbatches=2, repeats=2)
  with pytest.raises(ConfigError, match=r'num_layers=2 does not split into mesh.stage=2 x '
                                        r'train.pipeline_repeats=2 groups'):
    validate(config, 8)
  config = _config((8, 1, 1, 1, 1), layers=2, repeats=2)
  with pytest.raises(ConfigError, match='pipeline_repeats=2: the circular pipeline schedule '
                                        'needs mesh.stage > 1'):
    validate(config, 8)


_FOUR_AXES = '''
import sys
from tests.support.helpers import assert_same_run, engine_run, single_device_run
from tests.parity.test_pipeline import _config
import jax
assert jax.device_count() == 16, jax.device_count()
mesh = (2, 1, 2, 2, 2)  # data x tensor x context x stage, 16 devices.
reference = single_device_run(_config(layers=2), 3)
for mode in ('manual', 'auto'):
  assert_same_run(engine_run(_config(mesh, layers=2, microbatches=2), mode, 3), reference)
  print(mode, 'matches', flush=True)
'''


@pytest.mark.slow
def test_four_axes_at_once_on_16_devices():
  """data 2 x tensor 2 x context 2 x stage 2 needs 16 devices: a child process has them."""
  env = dict(os.environ, XLA_FLAGS=os.environ['XLA_FLAGS'] +
             ' --xla_force_host_platform_device_count=16')
  proc = subprocess.run([sys.executable, '-c', _FOUR_AXES], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'manual matches' in proc.stdout and 'auto matches' in proc.stdout


def test_bubble_fit_recovers_the_schedule_bubble():
  """engine.analysis.bubble's fit, on step times that follow the schedule exactly: c per
  iteration of L / (S R) layers, R M + S - 1 iterations, nothing else."""
  stages, repeats, per_iteration = 4, 2, 0.01
  counts = [4, 8, 12, 16]
  seconds = [per_iteration * (repeats * m + stages - 1) for m in counts]
  slope, measured = fit_bubble(counts, seconds)
  assert slope == pytest.approx(per_iteration * repeats)
  assert measured == pytest.approx([bubble_fraction(stages, m, repeats) for m in counts])
