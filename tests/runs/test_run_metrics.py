"""Training metrics worth plotting: interval-mean train loss, throughput without eval and
checkpoint time, MFU, peak memory, eval perplexity, summary.json and loss_curve.png."""

import importlib.util
import json
import shutil
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from engine.workdir import summary as run_summary
from engine.train.clock import LoopClock
from engine.train.metrics import MetricsWriter
from engine.train.loop import DeferredMetrics, TrainResult, train
from engine.errors import ConfigError
from engine.validation import validate
from tests.support import wandb_records
from tests.support.helpers import ATOL, single_device_run, tiny_config

STEPS = 6
find_spec = importlib.util.find_spec


def _config(steps=STEPS):
  config = tiny_config(mesh=(8, 1, 1), steps=steps)
  config.train.log_every = 3
  config.train.eval_every = 3
  config.train.loggers = 'tensorboard,jsonl,wandb'
  config.train.wandb_mode = 'offline'
  config.train.wandb_project = 'tests'
  return config


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('run')
  result = train(_config(), str(workdir))
  with open(workdir / 'metrics.jsonl') as f:
    records = [json.loads(line) for line in f]
  return workdir, result, records


@pytest.mark.slow
def test_the_logged_train_loss_is_the_mean_over_the_interval(run):
  _, result, records = run
  per_step = single_device_run(_config(), STEPS).losses  # The reference's own steps.
  expected = {3: np.mean(per_step[:3]), 6: np.mean(per_step[3:])}
  np.testing.assert_allclose([result.train_interval_losses[s] for s in (3, 6)],
                             [expected[3], expected[6]], atol=ATOL, rtol=0)
  np.testing.assert_allclose([result.train_losses[s] for s in (3, 6)],
                             [per_step[2], per_step[5]], atol=ATOL, rtol=0)  # The step's own.
  logged = {r['step']: r['train/loss'] for r in records if 'train/loss' in r}
  assert logged == result.train_interval_losses
  assert abs(logged[6] - per_step[5]) > 1e-4  # The mean is not the last step's loss.


@pytest.mark.slow
def test_eval_perplexity_summary_and_loss_curve(run):
  workdir, result, records = run
  evals = [r for r in records if 'eval/loss' in r]
  assert [r['step'] for r in evals] == [3, 6]
  for r in evals:
    assert r['eval/perplexity'] == pytest.approx(np.exp(r['eval/loss']), rel=1e-12)
  train_lines = [r for r in records if 'train/loss' in r]
  assert all(r['train/peak_memory_bytes'] > 0 for r in train_lines)
  assert not any('train/mfu' in r for r in records)  # CPU: no known peak.
  summary = json.loads((workdir / 'summary.json').read_text())
  assert set(run_summary.SUMMARY_KEYS) <= set(summary)
  best = min(evals, key=lambda r: r['eval/loss'])
  assert summary == {**summary, 'status': 'finished', 'final_step': STEPS, 'num_steps': STEPS,
                     'final_train_loss': train_lines[-1]['train/loss'],
                     'final_eval_loss': evals[-1]['eval/loss'],
                     'best_eval_loss': best['eval/loss'], 'best_eval_step': best['step'],
                     'eval_perplexity': evals[-1]['eval/perplexity'], 'mfu': None,
                     'peak_memory_bytes': result.memory['train_step']['peak_estimate_bytes'],
                     'peak_memory_source': 'compiled estimate', 'mode': 'auto', 'mesh': '8x1x1',
                     'model': summary['model']}
  speeds = [r['train/tokens_per_s'] for r in train_lines if 'train/tokens_per_s' in r]
  assert summary['tokens_per_s'] == pytest.approx(float(np.median(speeds)))
  assert summary['model'] and summary['wall_s'] > 0 and result.summary == summary
  assert (workdir / 'loss_curve.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def _tensorboard_tags(directory) -> set[str]:
  """The scalar tags of TFRecord event files: u64 length, u32 crc, the Event, u32 crc."""
  tags = set()
  for path in directory.glob('events.out.tfevents.*'):
    data = path.read_bytes()
    while data:
      (length,) = struct.unpack('<Q', data[:8])
      event = event_pb2.Event.FromString(data[12:12 + length])
      tags |= {value.tag for value in event.summary.value}
      data = data[16 + length:]
  return tags


@pytest.mark.slow
def test_tensorboard_has_the_new_scalars(run):
  workdir, _, _ = run
  tags = _tensorboard_tags(workdir / 'tensorboard')
  assert {'train/loss', 'train/tokens_per_s', 'train/peak_memory_bytes', 'eval/loss',
          'eval/perplexity', 'goodput/share', 'badput/startup_s',
          'badput/checkpoints_s'} <= tags, tags


@pytest.mark.slow
def test_wandb_logs_what_metrics_jsonl_logs_and_a_resume_continues_its_run(run, tmp_path):
  workdir, _, records = run
  (first,) = wandb_records.offline_runs(workdir)
  logged = wandb_records.read(first)
  run_id = json.loads((workdir / 'wandb_run.json').read_text())['id']
  assert (logged['id'], logged['project'], logged['name']) == (run_id, 'tests', workdir.name)
  assert logged['config']['train']['loggers'] == 'tensorboard,jsonl,wandb'
  assert logged['config']['model'] == _config().model.to_dict()
  history = [{k: v for k, v in h.items() if not k.startswith('_')} for h in logged['history']]
  assert history == records  # Every scalar, at its step, in order.
  # A resume (here, of a copy) continues the same W&B run from its checkpoint's step.
  resumed = tmp_path / 'resumed'
  shutil.copytree(workdir, resumed)
  longer = _config(steps=9)
  longer.optim.decay_steps = STEPS  # The schedule keeps its end.
  train(longer, str(resumed))
  first, second = wandb_records.offline_runs(resumed)
  assert wandb_records.read(second)['id'] == run_id
  assert [h['step'] for h in wandb_records.read(second)['history']] == [9, 9]  # Train, eval.


def test_loggers_are_checked(monkeypatch):
  config = tiny_config()
  for loggers, message in (
      ('tensorboard,wandb', r"leaves out jsonl: metrics.jsonl is the run's record .* e\.g\. "
                            r'tensorboard,wandb,jsonl\.'),
      ('jsonl,mlflow', r"'mlflow' is not a logger; name any of jsonl, tensorboard, wandb")):
    config.train.loggers = loggers
    with pytest.raises(ConfigError, match=message):
      validate(config, 8)
  config.train.loggers, config.train.wandb_mode = 'jsonl,wandb', 'online'
  monkeypatch.delenv('WANDB_API_KEY', raising=False)
  monkeypatch.setenv('NETRC', '/nonexistent/netrc')
  with pytest.raises(ConfigError, match=r'online, but no W&B API key is configured '
                     r'\(WANDB_API_KEY, or `wandb login`\); log in, or pass '
                     r'--config.train.wandb_mode=offline'):
    validate(config, 8)
  monkeypatch.setenv('WANDB_API_KEY', 'x' * 40)
  validate(config, 1)  # A key: nothing to refuse.
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *a: None if name == 'wandb' else find_spec(name, *a))
  with pytest.raises(ConfigError, match=r'names wandb, but the wandb package is not installed; '
                     r'pip install -e "\.\[wandb\]"'):
    validate(config, 8)


def test_throughput_leaves_out_the_time_at_sync_points(tmp_path):
  now = [100.0]
  clock = LoopClock(now=lambda: now[0])
  writer = MetricsWriter(tmp_path, num_steps=10, tokens_per_step=1000, flops_per_token=2.0,
                         peak_flops=8000.0, clock=clock)
  clock.start()
  with clock.phase('device'):
    now[0] += 3.0  # Steps 1-4 take 3 s...
  with clock.phase('evaluation'):
    now[0] += 2.0  # ... an eval and a checkpoint save 5 s ...
  with clock.phase('checkpoints'):
    now[0] += 3.0
  with clock.phase('data'):
    now[0] += 1.0  # ... and more steps 1 s.
  writer.log_train(4, 1.0, 1e-3, 0.5)
  writer.close()
  record = json.loads((tmp_path / 'metrics.jsonl').read_text())
  assert record['train/steps_per_s'] == pytest.approx(4 / 4.0)
  assert record['train/tokens_per_s'] == pytest.approx(1000.0)
  assert record['train/mfu'] == pytest.approx(1000.0 * 2.0 / 8000.0)


def test_mfu_uses_the_chips_peak_times_the_devices():
  peak = run_summary.peak_flops_of_devices('NVIDIA H100 80GB HBM3', 'bfloat16', 8)
  assert peak == 8 * 989e12
  assert run_summary.mfu(989e12, peak) == pytest.approx(1 / 8)
  assert run_summary.peak_flops_of_devices('cpu', 'float32', 8) is None
  assert run_summary.mfu(1e9, None) is None
  assert run_summary.mesh_string({'data': 2, 'fsdp': 2, 'tensor': 2, 'context': 1,
                                  'stage': 1}) == '2x2x2'
  assert run_summary.mesh_string({'data': 2, 'fsdp': 1, 'tensor': 1, 'context': 1,
                                  'stage': 2, 'expert': 1}) == '2x1x1x1x2'
  assert run_summary.mesh_string({'data': 2, 'fsdp': 1, 'tensor': 1, 'context': 1, 'stage': 1,
                                  'expert': 4}) == '2x1x1x1x1x4'


class _Writer:
  def __init__(self):
    self.logged = []

  def log_train(self, step, loss, learning_rate, grad_norm, extra):
    self.logged.append((step, loss, extra))


def test_skipped_steps_stay_out_of_the_mean():
  writer, result = _Writer(), TrainResult({}, {}, {}, 0, {})
  deferred = DeferredMetrics(writer, result, 3, 3, run_summary.PeakMemory(123))
  for step, loss in ((1, 2.0), (2, np.nan), (3, 4.0)):
    deferred.after_dispatch(step, None, {'loss': np.float32(loss), 'grad_norm': np.float32(1.0),
                                         'learning_rate': np.float32(1e-3)})
  deferred.flush()
  assert writer.logged == [(3, 3.0, {'train/peak_memory_bytes': 123})]
  assert result.train_losses == {3: 4.0} and result.train_interval_losses == {3: 3.0}
