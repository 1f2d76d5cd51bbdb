"""One run per workdir (engine/workdir/lock.py): a second run is refused in one line naming the
holder, before it writes anything; the lock of a run that was killed is taken over."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from engine import main
from engine.workdir import lock as run_lock
from engine.workdir.checkpoint import latest_complete_step
from engine.train.loop import train
from experiments import tiny
from launch.local import free_port, process_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny experiment, shrunk: a metrics line every step, a checkpoint every 2.
TINY = ['--config=experiments/tiny.py', '--config.model.num_layers=1', '--config.data.seq_len=16',
        '--config.train.log_every=1', '--config.train.checkpoint_every=2',
        '--config.train.eval_every=100000']


def _start(workdir, *extra, env=None):
  return subprocess.Popen(
      [sys.executable, '-m', 'engine.main', *TINY, f'--workdir={workdir}', *extra], cwd=ROOT,
      env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metrics_steps(workdir) -> list[int]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return []
  return [l['step'] for l in map(json.loads, open(path).read().splitlines()) if 'train/loss' in l]


def _wait(condition, proc, what):
  deadline = time.monotonic() + 300
  while not condition():
    assert proc.poll() is None, proc.communicate()[1][-4000:]
    assert time.monotonic() < deadline, f'no {what} within 300 s'
    time.sleep(0.1)


def _assert_refused(proc, workdir, pid, processes=1):
  """`proc` ended with status 2 and one line naming the holder."""
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 2, err[-4000:]
  lines = [l for l in err.splitlines() if l.startswith('error:')]
  of = f' (process 0 of {processes} jax processes)' if processes > 1 else ''
  assert len(lines) == 1, err[-4000:]
  assert lines[0].startswith(f'error: --workdir={workdir} is in use by another run (host '
                             f'{socket.gethostname()}, pid {pid}{of}, started '), lines
  assert lines[0].endswith('or pass another --workdir.'), lines
  assert 'Traceback' not in out + err


@pytest.mark.slow
def test_a_second_run_is_refused_and_the_first_finishes(tmp_path):
  first = _start(tmp_path, '--config.train.num_steps=100000')
  _wait(lambda: len(_metrics_steps(tmp_path)) >= 2, first, 'metrics')
  config_json = (tmp_path / 'config.json').read_text()
  # The same command again, and one with another model width, at the same time.
  again = _start(tmp_path, '--config.train.num_steps=100000')
  wider = _start(tmp_path, '--config.model.embed_dim=32')
  _assert_refused(again, tmp_path, first.pid)
  _assert_refused(wider, tmp_path, first.pid)
  assert (tmp_path / 'config.json').read_text() == config_json
  first.send_signal(signal.SIGTERM)  # Checkpoints the current step and exits 0.
  _, err = first.communicate(timeout=120)
  assert first.returncode == 0, err[-4000:]
  stopped = latest_complete_step(str(tmp_path / 'checkpoints'))
  assert _metrics_steps(tmp_path) == list(range(1, stopped + 1))  # None lost.
  assert not (tmp_path / run_lock.LOCK_FILE).exists()  # Released.


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_and_the_run_resumes(tmp_path, caplog):
  killed = _start(tmp_path, '--config.train.num_steps=100000')
  checkpoints = tmp_path / 'checkpoints'
  _wait(lambda: (checkpoints / '2').exists(), killed, 'checkpoint')
  killed.kill()
  killed.communicate()
  assert json.loads((tmp_path / run_lock.LOCK_FILE).read_text())['pid'] == killed.pid
  latest = latest_complete_step(str(checkpoints))
  config = tiny.get_config()
  config.model.num_layers, config.data.seq_len = 1, 16
  config.train.update(num_steps=latest + 1, log_every=1, checkpoint_every=2, eval_every=100000)
  config.optim.decay_steps = 100000  # The killed run's schedule, which num_steps would move.
  resumed = train(config, str(tmp_path))
  assert sorted(resumed.train_losses) == [latest + 1]
  assert f'from a run that is gone (host {socket.gethostname()}, pid {killed.pid}, ' in caplog.text
  assert f'pid {killed.pid} is not running' in caplog.text
  assert not (tmp_path / run_lock.LOCK_FILE).exists()


@pytest.fixture
def holder():
  """A live process holding a lock record (written by `lock(workdir)`)."""
  proc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])

  def lock(workdir, **changes):
    record = dict(run_lock.record('held', proc.pid), **changes)
    (workdir / run_lock.LOCK_FILE).write_text(json.dumps(record))
    return record
  lock.pid = proc.pid
  yield lock
  proc.kill()
  proc.wait()


def test_a_refused_run_writes_nothing(tmp_path, holder, capsys):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  record = holder(workdir)
  assert main.run([*TINY, f'--workdir={workdir}']) == 2
  err = capsys.readouterr().err
  assert [l for l in err.splitlines() if l.startswith('error:')] == [
      run_lock.refusal(workdir, record).join(['error: ', ''])]
  assert f'pid {holder.pid}, started ' in err
  assert os.listdir(workdir) == [run_lock.LOCK_FILE]
  assert json.loads((workdir / run_lock.LOCK_FILE).read_text()) == record


@pytest.mark.slow
def test_every_process_of_a_refused_multi_process_run_stops(tmp_path, holder):
  holder(tmp_path, processes=2)
  port = free_port()
  procs = [_start(tmp_path, env=process_env(dict(os.environ), i, 2, 1, port)) for i in range(2)]
  for proc in procs:
    _assert_refused(proc, tmp_path, holder.pid, processes=2)
  assert os.listdir(tmp_path) == [run_lock.LOCK_FILE]


def test_staleness(holder, tmp_path):
  """Same host: the pid decides (and its start time, against reuse); elsewhere: the heartbeat."""
  live = run_lock.record('x', holder.pid)
  assert run_lock.stale_reason(live) is None
  assert run_lock.stale_reason(dict(live, pid_start=live['pid_start'] + 1)) == (
      f'pid {holder.pid} is now another process')
  elsewhere = dict(live, host='elsewhere', pid=1)
  assert run_lock.stale_reason(elsewhere) is None  # A fresh heartbeat.
  old = time.time() - run_lock.STALE_S - 5
  assert run_lock.stale_reason(dict(elsewhere, heartbeat=old)).startswith('its heartbeat is ')
  rebooted = dict(live, boot_id='before the reboot', heartbeat=old)
  assert run_lock.stale_reason(rebooted) is not None
  # take: a live holder is returned; a stale one is replaced by this run's record.
  path = tmp_path / run_lock.LOCK_FILE
  path.write_text(json.dumps(elsewhere))
  assert run_lock.take(path, run_lock.record('mine')) == elsewhere
  path.write_text(json.dumps(dict(elsewhere, heartbeat=old)))
  assert run_lock.take(path, run_lock.record('mine')) is None
  assert json.loads(path.read_text())['run_id'] == 'mine'
  assert os.listdir(tmp_path) == [run_lock.LOCK_FILE]  # No temporary files left.
