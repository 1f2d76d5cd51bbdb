"""The hang and straggler watchdog (engine/train/watchdog.py): a run that stops making progress
ends with one `error:` line naming whom it waits for and each process's Python stacks in the
workdir; a process slowed on purpose is named in a warning. Faults are planted by
tests/support/fault_experiment.py, or by SIGSTOP."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from engine.train import watchdog
from tests.support.processes import descendants, kill_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = 'tests/support/fault_experiment.py'


def test_a_straggler_is_a_process_slower_than_the_factor_times_the_others():
  assert watchdog.stragglers({0: 0.010, 1: 0.012, 2: 0.300}, 2.0) == [2]
  assert watchdog.stragglers({0: 0.010, 1: 0.019}, 2.0) == []  # Under the factor.
  assert watchdog.stragglers({0: 0.001, 1: 0.005}, 2.0) == []  # 5x, but 4 ms: noise.
  assert watchdog.stragglers({0: 0.5}, 2.0) == []  # Nobody to compare with.


def test_the_stacks_of_every_thread_go_to_the_workdir(tmp_path):
  from engine.workdir import run_dir  # pylint: disable=g-import-not-at-top
  path = watchdog.dump_stacks(run_dir.resolve(str(tmp_path)))
  assert path == tmp_path / 'stacks' / 'process_0.txt'
  assert 'test_the_stacks_of_every_thread_go_to_the_workdir' in path.read_text()


def _output(proc, lines):
  for line in proc.stdout:
    lines.append((time.monotonic(), line.rstrip('\n')))


def _start(command):
  proc = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines = []
  reader = threading.Thread(target=_output, args=(proc, lines), daemon=True)
  reader.start()
  return proc, lines, reader


def _process_of_index(pid, index):
  """The engine.main process of launch.local's process `index` (its JAX_PROCESS_ID)."""
  for child in descendants(pid):
    with contextlib.suppress(OSError):
      environ = open(f'/proc/{child}/environ', 'rb').read().split(b'\0')
      cmdline = open(f'/proc/{child}/cmdline', 'rb').read()
      if f'JAX_PROCESS_ID={index}'.encode() in environ and b'engine.main' in cmdline:
        return child
  return None


def _run(command, timeout_s=240):
  """(exit status, [(time, line)]) of `command`, its process tree killed if it outlives
  `timeout_s`."""
  proc, lines, reader = _start(command)
  try:
    proc.wait(timeout=timeout_s)
  finally:
    kill_tree(proc.pid)
  reader.join(timeout=10)
  return proc.returncode, lines


def _wait_for(lines, text, timeout_s):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if any(text in line for _, line in lines):
      return
    time.sleep(0.1)
  raise AssertionError(f'no line with {text!r} in {timeout_s} s:\n' +
                       '\n'.join(line for _, line in lines)[-4000:])


@pytest.mark.slow
def test_a_run_whose_data_stops_coming_ends_with_one_line_and_its_stacks(tmp_path):
  code, lines = _run(
      [sys.executable, '-m', 'engine.main', f'--config={FAULTS}:process=0,hang_after=3,steps=20',
       f'--workdir={tmp_path}', '--config.train.hang_timeout_s=3'])
  errors = [line for _, line in lines if line.startswith('error:')]
  assert code == 1 and len(errors) == 1, '\n'.join(l for _, l in lines)[-4000:]
  assert errors[0].startswith('error: the run has made no progress for 3 s (train.hang_timeout_s) '
                              'since it dispatched step 3. Python stacks: '
                              f'{tmp_path}/stacks/.'), errors[0]
  stacks = (tmp_path / 'stacks' / 'process_0.txt').read_text()
  assert 'fault_experiment.py' in stacks and 'Thread' in stacks  # Where it waits, every thread.


def _launcher(tmp_path, arg, *flags):
  return [sys.executable, '-m', 'launch.local', '--num_processes=2', '--devices_per_process=4',
          '--', sys.executable, '-m', 'engine.main', '--heartbeat_timeout_s=60',
          f'--config={FAULTS}:{arg}', f'--workdir={tmp_path}', *flags]


@pytest.mark.slow
def test_a_stopped_process_is_named_and_every_process_stops(tmp_path):
  proc, lines, reader = _start(_launcher(
      tmp_path, 'steps=400,checkpoint_every=400,decay_steps=400',
      '--config.train.hang_timeout_s=4', '--config.train.log_every=1'))
  try:
    _wait_for(lines, '[p0] I', 120)
    _wait_for(lines, 'step 10/400', 180)
    stopped = _process_of_index(proc.pid, 1)
    assert stopped is not None
    os.kill(stopped, signal.SIGSTOP)
    _wait_for(lines, '[p0] error:', 60)
    os.kill(stopped, signal.SIGCONT)  # Woken, it reads process 0's report and stops too.
    proc.wait(timeout=120)
  finally:
    kill_tree(proc.pid)
  reader.join(timeout=10)
  output = '\n'.join(line for _, line in lines)
  errors = [line for _, line in lines if line.startswith('[p0] error:')]
  assert proc.returncode != 0 and len(errors) == 1, output[-4000:]
  assert 'error: the run has made no progress for 4 s (train.hang_timeout_s) since it dispatched ' \
         'step' in errors[0], errors[0]
  assert ': process 1 stopped responding (its last report, at step' in errors[0], errors[0]
  assert [line for _, line in lines if line.startswith('[p1] error:')] == [
      '[p1] error: process 0 of 2 failed, so process 1 stops too: ' + errors[0][len(
          '[p0] error: '):]], output[-4000:]
  for index in (0, 1):  # Each process's stacks, the woken one's written as it stopped.
    assert 'Thread' in (tmp_path / 'stacks' / f'process_{index}.txt').read_text()
  assert 'Traceback' not in output, output[-4000:]


@pytest.mark.slow
def test_a_slowed_process_is_named_a_straggler(tmp_path):
  code, lines = _run(_launcher(
      tmp_path, 'process=1,delay_s=0.25,steps=12,checkpoint_every=12,decay_steps=12',
      '--config.train.log_every=3', '--config.train.eval_every=12'))
  output = '\n'.join(line for _, line in lines)
  assert code == 0, output[-4000:]
  warnings = [line for _, line in lines if 'Straggler: process 1 spends' in line]
  assert warnings and all(line.startswith('[p0]') for line in warnings), output[-4000:]
  assert not any('Straggler: process 0' in line for _, line in lines)
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert summary['status'] == 'finished'
