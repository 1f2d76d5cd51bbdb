"""Checkpoints that survive: damage found on restore, failed saves cleaned up, kill -9, remote
(gs://-style) workdir paths."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath
from etils.epath import testing as epath_testing

from engine.workdir import run_dir as workdir_lib
from engine.workdir.checkpoint import latest_complete_step
from engine.workdir.checksums import CHECKSUMS_FILE, file_checksums, find_damage
from engine.errors import CheckpointError
from engine.loggers.json_lines import JsonLines
from engine.train.loop import train
from tests.support.helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(steps, **train_keys):
  config = tiny_config(mesh=(2, 2, 2), steps=steps)
  config.optim.decay_steps = 8  # The schedule must not depend on where the run stops.
  config.train.checkpoint_every = 2
  config.train.update(train_keys)
  return config


@pytest.fixture(scope='module')
def saved_run(tmp_path_factory):
  """Checkpoints of steps 2 and 4, written synchronously (the asynchronous path is every other
  test's), and the losses of an uninterrupted 6-step run to compare resumed runs with."""
  workdir = tmp_path_factory.mktemp('saved')
  train(_config(4, async_checkpoints=False), str(workdir))
  full = train(_config(6), str(tmp_path_factory.mktemp('full')))
  return workdir, full.train_losses


def _largest_array_file(step_dir):
  files = [os.path.join(d, f) for d, _, names in os.walk(step_dir / 'state') for f in names]
  return max((f for f in files if f'{os.sep}d{os.sep}' in f), key=os.path.getsize)


def _flip_byte(path, where=0.5):
  data = bytearray(open(path, 'rb').read())
  data[int(len(data) * where)] ^= 0x10
  open(path, 'wb').write(data)


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


DAMAGE = {
    'flipped byte in an array file': (lambda s: _flip_byte(_largest_array_file(s)),
                                      'different bytes (checksum mismatch)'),
    'truncated array file': (lambda s: _truncate(_largest_array_file(s)), 'were written'),
    'deleted array file': (lambda s: os.remove(_largest_array_file(s)), 'is missing'),
    'flipped byte in the array metadata': (lambda s: _flip_byte(s / 'state' / '_METADATA'),
                                           'state/_METADATA has the right size but different'),
    'truncated data-iterator record': (lambda s: _truncate(s / 'data' / 'metadata'),
                                       'data/metadata has'),
    'deleted checksums': (lambda s: os.remove(s / CHECKSUMS_FILE), f'{CHECKSUMS_FILE} is missing'),
    'garbled checksums': (lambda s: _truncate(s / CHECKSUMS_FILE), 'not valid JSON'),
}


@pytest.mark.slow
@pytest.mark.parametrize('damage', DAMAGE)
def test_a_damaged_latest_checkpoint_is_reported_by_step_and_cause(damage, saved_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(saved_run[0], workdir)
  assert find_damage(epath.Path(workdir / 'checkpoints' / '4')) is None
  harm, cause = DAMAGE[damage]
  harm(workdir / 'checkpoints' / '4')
  before = sorted(os.listdir(workdir / 'checkpoints'))
  with pytest.raises(CheckpointError, match='The checkpoint of step 4 .* is damaged') as error:
    train(_config(6), str(workdir))
  message = str(error.value)
  assert cause in message, message
  assert 'the newest intact one is step 2' in message
  assert '--config.train.skip_damaged_checkpoints=true' in message
  assert sorted(os.listdir(workdir / 'checkpoints')) == before  # Nothing was touched.


@pytest.mark.slow
def test_skip_damaged_checkpoints_resumes_from_the_newest_intact_one(saved_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(saved_run[0], workdir)
  _flip_byte(_largest_array_file(workdir / 'checkpoints' / '4'))
  resumed = train(_config(6, skip_damaged_checkpoints=True), str(workdir))
  # Steps 3-6 redone from step 2's checkpoint, exactly as the uninterrupted run did them.
  assert sorted(resumed.train_losses) == [3, 4, 5, 6]
  for step, loss in resumed.train_losses.items():
    assert loss == saved_run[1][step], step
  # The damaged checkpoint was kept, aside; its step was saved again, intact.
  assert [name.split('.')[0] for name in os.listdir(workdir / 'damaged_checkpoints')] == ['4']
  assert find_damage(epath.Path(workdir / 'checkpoints' / '4')) is None
  lines = [json.loads(line) for line in open(workdir / 'metrics.jsonl')]
  assert [line['step'] for line in lines if 'train/loss' in line] == list(range(1, 7))


def _main(*args, preamble=''):
  """`python -m engine.main ...` as a child process (conftest's 8 CPU devices)."""
  code = (f'{preamble}\nimport sys\nfrom absl import app\nfrom engine import main\n'
          f'sys.argv = ["engine.main", *{list(args)!r}]\n'
          'app.run(main.main, flags_parser=main.parse_flags)')
  return [sys.executable, '-c', code]


_TINY = ['--config=experiments/tiny.py:steps=200,mesh=2x2x2', '--config.train.checkpoint_every=1',
         '--config.train.log_every=1', '--config.optim.decay_steps=200',
         '--config.model.num_layers=1']


@pytest.mark.slow
def test_a_failed_save_leaves_no_partial_checkpoint_and_one_clear_error(tmp_path):
  # Files above 100 kB cannot be written ("File too large"), so the first save fails.
  limit = ('import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
           'resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))')
  proc = subprocess.run(_main(*_TINY, f'--workdir={tmp_path}', preamble=limit), cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'Saving the checkpoint of step 1' in errors[0], proc.stderr[-3000:]
  assert 'File too large' in errors[0] and 'partial files were removed' in errors[0]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert len(proc.stderr.splitlines()) < 40, proc.stderr  # Was 439 lines of library tracebacks.
  assert os.listdir(tmp_path / 'checkpoints') == []


def test_a_workdir_file_that_cannot_be_written_is_one_error_line(tmp_path, capsys):
  from engine import main as engine_main
  (tmp_path / 'metrics.jsonl').mkdir()  # Where the metrics go: a directory cannot be opened.
  code = engine_main.run([_TINY[0], f'--workdir={tmp_path}', '--config.train.num_steps=1'])
  errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith('error:')]
  assert code == 1 and len(errors) == 1, errors
  assert errors[0].startswith(f'error: --workdir={tmp_path}: [Errno 21] Is a directory:'), errors


@pytest.mark.slow
def test_kill_9_loses_only_the_steps_after_the_last_checkpoint(tmp_path):
  run = subprocess.Popen(_main(*_TINY, f'--workdir={tmp_path}'), cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  checkpoints = tmp_path / 'checkpoints'
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:  # Kill it while saves are going on every step.
    if checkpoints.exists() and len([d for d in os.listdir(checkpoints) if d.isdigit()]) >= 3:
      break
    assert run.poll() is None
    time.sleep(0.05)
  run.send_signal(signal.SIGKILL)
  run.wait()
  latest = latest_complete_step(checkpoints)
  assert find_damage(epath.Path(checkpoints / str(latest))) is None
  # The rerun resumes from it, removes any half-written one, and redoes the lost steps exactly
  # as an uninterrupted run does them.
  steps = latest + 3
  again = _main(*_TINY, f'--workdir={tmp_path}', f'--config.train.num_steps={steps}')
  subprocess.run(again, cwd=ROOT, check=True, capture_output=True, timeout=300)
  from engine import main as engine_main
  # The uninterrupted run in this process (the same 8 devices and XLA flags: the same program).
  assert engine_main.run([*_TINY, f'--workdir={tmp_path / "full"}',
                          f'--config.train.num_steps={steps}']) == 0
  losses = lambda d: [(line['step'], line['train/loss'])
                      for line in map(json.loads, open(d / 'metrics.jsonl'))
                      if 'train/loss' in line]
  assert losses(tmp_path) == losses(tmp_path / 'full')
  assert not [d for d in os.listdir(checkpoints) if not d.isdigit()]
  # The goodput counts both attempts: the killed one's steps after the checkpoint as lost.
  attempts = json.loads((tmp_path / 'goodput.json').read_text())['attempts']
  assert len(attempts) == 2 and attempts[1]['first_step'] == latest
  lost = json.loads((tmp_path / 'summary.json').read_text())['badput_s']['lost_steps']
  assert (lost > 0) == (attempts[0]['last_step'] > latest)


@pytest.fixture
def fake_bucket(tmp_path):
  """gs://bucket/... paths served from tmp_path by etils.epath (what Orbax and the engine use)."""
  def local(path):
    return str(path).replace('gs://bucket', str(tmp_path / 'bucket'))

  def on_path(fn, path, *args, **kwargs):
    return fn(local(path), *args, **kwargs)

  def on_two_paths(fn, path, dst, *args, **kwargs):
    return fn(local(path), local(dst), *args, **kwargs)

  def walk(fn, top, **kwargs):
    for parent, dirs, files in fn(local(top), **kwargs):
      yield str(parent).replace(str(tmp_path / 'bucket'), 'gs://bucket'), dirs, files

  def glob(fn, pattern):
    return [p.replace(str(tmp_path / 'bucket'), 'gs://bucket') for p in fn(local(pattern))]

  (tmp_path / 'bucket').mkdir()
  with epath_testing.mock_epath(
      open=on_path, exists=on_path, isdir=on_path, listdir=on_path, makedirs=on_path,
      mkdir=on_path, remove=on_path, rmtree=on_path, stat=on_path, rename=on_two_paths,
      replace=on_two_paths, copy=on_two_paths, walk=walk, glob=glob):
    yield tmp_path / 'bucket'


def test_remote_workdirs_keep_their_uri_and_go_through_epath(fake_bucket):
  uri = 'gs://bucket/run'
  workdir = workdir_lib.prepare(uri)
  assert str(workdir) == uri  # Not '/cwd/gs:/bucket/run'.
  assert (fake_bucket / 'run').is_dir()
  config = tiny_config()
  workdir_lib.write_config(config, workdir)
  assert json.loads((fake_bucket / 'run' / 'config.json').read_text())['model']['embed_dim'] == 32
  workdir_lib.check_resumable(config, workdir)
  config.model.embed_dim = 64
  with pytest.raises(Exception, match='different model config'):
    workdir_lib.check_resumable(config, workdir)
  # metrics.jsonl: object stores cannot append, so it is rewritten; a resume drops later steps.
  lines = JsonLines(workdir, start_step=0, remote_every_s=0)
  for step in (1, 2, 3):
    lines.write(step, {'train/loss': float(step)})
  lines.close()
  JsonLines(workdir, start_step=2).close()
  written = (fake_bucket / 'run' / 'metrics.jsonl').read_text().splitlines()
  assert [json.loads(line)['step'] for line in written] == [1, 2]
  # Checksums are written and read through epath (Orbax's own gs:// access needs the real
  # google-cloud-storage client, so the Checkpointer is not run here).
  step = fake_bucket / 'run' / 'checkpoints' / '7'
  (step / 'state').mkdir(parents=True)
  (step / 'state' / 'array').write_bytes(np.arange(100, dtype=np.float32).tobytes())
  record = file_checksums(epath.Path('gs://bucket/run/checkpoints/7'))
  assert list(record) == ['state/array'] and record['state/array'][0] == 400
  (step / CHECKSUMS_FILE).write_text(json.dumps(record))
  assert find_damage(epath.Path('gs://bucket/run/checkpoints/7')) is None
  _flip_byte(step / 'state' / 'array')
  assert 'checksum mismatch' in find_damage(epath.Path('gs://bucket/run/checkpoints/7'))


@pytest.mark.slow
def test_a_checkpoint_of_another_model_without_its_config_is_refused_clearly(saved_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(saved_run[0], workdir)
  os.remove(workdir / 'config.json')  # Nothing says which model the checkpoints belong to.
  config = _config(6)
  config.model.mlp_dim = 128
  with pytest.raises(CheckpointError, match=r'The checkpoint of step 4 .* could not be restored '
                     r'into this model: .*resume with that config, or use a new --workdir'):
    train(config, str(workdir))


@pytest.mark.slow
def test_a_quantized_run_resumes_in_bfloat16_and_back(tmp_path):
  """Checkpoints hold float32 state whatever the matmuls compute in: an int8 run's checkpoint
  resumes in bfloat16 with unquantized matmuls, whose checkpoint resumes in fp8; each resume
  starts from the step and parameters the run before it saved."""
  workdir = str(tmp_path / 'run')
  losses = {}
  for steps, dtype, precision in ((2, 'float32', 'int8'), (4, 'bfloat16', 'default'),
                                  (6, 'bfloat16', 'fp8')):
    config = _config(steps, async_checkpoints=False)
    config.model.dtype, config.model.matmul_precision = dtype, precision
    config.model.matmul_block = 8
    losses.update(train(config, workdir).train_losses)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(list(losses.values())))
  # The state carried over: step 3 starts from step 2's parameters, not from a fresh start
  # (whose loss is step 1's, the highest of a converging run).
  assert losses[3] < losses[1] - 0.01


@pytest.mark.slow
def test_the_local_tier_resumes_past_the_workdir_and_skips_its_damaged_checkpoints(tmp_path):
  """Local checkpoints every step, the workdir's every 4: with the workdir's 4 and 5 gone, the
  run resumes from the local tier's step 3 and trains steps 4 and 5 as before, bitwise; a damaged
  local step 3 is skipped for its step 2."""
  import glob  # pylint: disable=g-import-not-at-top
  import shutil  # pylint: disable=g-import-not-at-top
  from engine.train.loop import train  # pylint: disable=g-import-not-at-top
  from tests.support.helpers import tiny_config  # pylint: disable=g-import-not-at-top

  def config(steps):
    c = tiny_config(mesh=(2, 4, 1), steps=steps)
    c.train.checkpoint_every, c.optim.decay_steps = 4, 8
    c.train.local_checkpoint_dir, c.train.local_checkpoint_every = str(tmp_path / 'local'), 1
    return c

  workdir = tmp_path / 'run'
  first = train(config(5), str(workdir))
  local, = glob.glob(str(tmp_path / 'local' / '*' / '*' / 'process_0'))
  assert sorted(os.listdir(local)) == ['2', '3']  # The newest two; 4 and 5 in the workdir.
  for step in ('4', '5'):
    shutil.rmtree(workdir / 'checkpoints' / step)
  shutil.copytree(local, tmp_path / 'kept')
  again = train(config(5), str(workdir))
  assert sorted(again.train_losses) == [4, 5]
  assert [again.train_losses[s] for s in (4, 5)] == [first.train_losses[s] for s in (4, 5)]
  # The same restart with the local step 3 damaged: from its step 2.
  shutil.rmtree(workdir / 'checkpoints')
  shutil.rmtree(local)
  shutil.copytree(tmp_path / 'kept', local)
  damaged = sorted(glob.glob(f'{local}/3/state/**/*', recursive=True), key=os.path.getsize)[-1]
  with open(damaged, 'r+b') as f:
    f.write(b'\0' * 16)
  shutil.rmtree(workdir / 'metrics.jsonl', ignore_errors=True)
  third = train(config(5), str(workdir))
  assert sorted(third.train_losses) == [3, 4, 5]
  assert [third.train_losses[s] for s in (3, 4, 5)] == [first.train_losses[s] for s in (3, 4, 5)]
