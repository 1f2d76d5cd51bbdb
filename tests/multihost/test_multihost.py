"""Real multi-process runs on this machine (jax.distributed over gloo), through launch/local.py.

Every run trains tests/support/multihost_experiment.py (the tiny model) and is checked against the
single-device reference, step by step (losses and gradient norms), to fp32 tolerance (see
tests/support/helpers.py).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from engine.workdir.checkpoint import latest_complete_step
from engine.train.loop import train
from tests.support import multihost_experiment
from tests.support.helpers import ATOL, single_device_run

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


REFERENCE_STEPS = 16  # Enough for the SIGTERM tests' rerun too (decay_steps fixes the schedule).


@pytest.fixture(scope='module')
def reference():
  return single_device_run(multihost_experiment.get_config(f'steps={REFERENCE_STEPS}'),
                           REFERENCE_STEPS)


def _launch(processes, devices, arg, workdir, background=False):
  command = [sys.executable, '-m', 'launch.local', f'--num_processes={processes}',
             f'--devices_per_process={devices}', '--', sys.executable, '-m', 'engine.main',
             f'--config=tests/support/multihost_experiment.py:{arg}', f'--workdir={workdir}']
  env = dict(os.environ)  # launch.local replaces the device count in XLA_FLAGS.
  if background:
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  return proc


def _logged_losses(workdir):
  lines = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  return {l['step']: l['train/loss'] for l in lines if 'train/loss' in l}


def _assert_logged_match(workdir, steps, reference):
  """The logged losses and gradient norms of `steps` equal the single-device run's."""
  lines = [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]
  logged = {l['step']: l for l in lines if 'train/loss' in l}
  index = [s - 1 for s in steps]
  np.testing.assert_allclose([logged[s]['train/loss'] for s in steps], reference.losses[index],
                             atol=ATOL, rtol=0)
  np.testing.assert_allclose([logged[s]['train/grad_norm'] for s in steps],
                             reference.grad_norms[index], rtol=ATOL, atol=0)


def test_a_run_resumes_on_other_process_counts_and_modes_exactly(reference, tmp_path, caplog):
  """2 processes x 4 devices (auto) -> 1 x 8 (manual) -> 4 x 2 (auto), each leg from the last
  one's checkpoint, data position included: the losses are the single-device run's throughout,
  and each resume says in one line what changed."""
  proc = _launch(2, 4, 'mode=auto,steps=4', tmp_path)
  assert '[p0]' in proc.stdout and 'process 1 of 2' in proc.stdout
  _assert_logged_match(tmp_path, [1, 2, 3, 4], reference)
  # Only process 0 writes metrics: one line per step, not two.
  assert sorted(_logged_losses(tmp_path)) == [1, 2, 3, 4]
  # The 2-process checkpoint resumes in this single process (8 devices), in the other mode.
  with caplog.at_level('INFO', logger='absl'):
    resumed = train(multihost_experiment.get_config('mode=manual,steps=6'), str(tmp_path))
  assert ('Resuming from step 4 on another layout: 2 processes x 4 devices, mesh 2x2x2, auto mode '
          '-> 1 process x 8 devices, mesh 2x2x2, manual mode.') in caplog.messages
  assert sorted(resumed.train_losses) == [5, 6]
  np.testing.assert_allclose([resumed.train_losses[s] for s in (5, 6)], reference.losses[4:6],
                             atol=ATOL)
  # And that checkpoint on 4 processes x 2 devices.
  proc = _launch(4, 2, 'mode=auto,steps=8', tmp_path)
  assert ('Resuming from step 6 on another layout: 1 process x 8 devices, mesh 2x2x2, manual mode '
          '-> 4 processes x 2 devices, mesh 2x2x2, auto mode.') in proc.stdout + proc.stderr
  _assert_logged_match(tmp_path, [5, 6, 7, 8], reference)


def test_manual_mode_with_the_data_axis_across_hosts_matches_single_device(reference, tmp_path):
  """mesh.dcn_data=2: the data axis laid out across the 2 hosts. (4 processes x 2 devices in
  auto mode: the last leg of the resume test above.)"""
  _launch(2, 4, 'mode=manual,steps=3,dcn_data=2', tmp_path)
  _assert_logged_match(tmp_path, [1, 2, 3], reference)


def _worker_pids(launcher_pid):
  """{process index: pid} of the launcher's children, from their environment."""
  found = {}
  children = open(f'/proc/{launcher_pid}/task/{launcher_pid}/children').read().split()
  for pid in map(int, children):
    try:
      env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
    except FileNotFoundError:
      continue
    for entry in env:
      if entry.startswith(b'JAX_PROCESS_ID='):
        found[int(entry.split(b'=')[1])] = pid
  return found


def test_killing_a_process_stops_the_launcher_and_keeps_checkpoints(tmp_path):
  launcher = _launch(2, 4, 'mode=auto,steps=100000,checkpoint_every=2', tmp_path,
                     background=True)
  checkpoints = tmp_path / 'checkpoints'
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    done = [int(d) for d in os.listdir(checkpoints) if d.isdigit()] if checkpoints.exists() else []
    if max(done, default=0) >= 4:
      break
    assert launcher.poll() is None, launcher.stdout.read()[-4000:]
    time.sleep(0.2)
  else:
    raise AssertionError('no checkpoint within 300 s')
  victim = _worker_pids(launcher.pid)[1]
  killed_at = time.monotonic()
  os.kill(victim, signal.SIGKILL)
  output, _ = launcher.communicate(timeout=120)
  stop_seconds = time.monotonic() - killed_at
  assert launcher.returncode != 0
  assert 'process 1 was killed by signal 9' in output
  assert stop_seconds < 30, stop_seconds  # Measured: well under a second.
  print(f'launcher exited {stop_seconds:.2f} s after the kill')
  # The last complete checkpoint is intact: a new run resumes from it.
  latest = latest_complete_step(str(checkpoints))
  assert latest >= 4
  resumed = train(multihost_experiment.get_config(f'steps={latest + 1}'), str(tmp_path))
  assert sorted(resumed.train_losses) == [latest + 1]


def test_without_a_launcher_the_survivor_stops_naming_the_lost_process(tmp_path):
  """The distributed runtime's heartbeat: process 0 stops by itself, bounded by the timeout."""
  from launch.local import free_port, process_env
  port = free_port()
  base = dict(os.environ)  # process_env replaces the device count in XLA_FLAGS.
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'engine.main', '--heartbeat_timeout_s=5',
       '--config=tests/support/multihost_experiment.py:steps=100000,checkpoint_every=2',
       f'--workdir={tmp_path}'], cwd=ROOT, env=process_env(base, i, 2, 4, port),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / 'checkpoints' / '2').exists():
      assert time.monotonic() < deadline and procs[0].poll() is None
      time.sleep(0.2)
    procs[1].kill()
    killed_at = time.monotonic()
    output, _ = procs[0].communicate(timeout=120)
    stop_seconds = time.monotonic() - killed_at
  finally:
    for p in procs:
      p.kill()
  assert procs[0].returncode != 0
  # The runtime names the silent process: 'Task 1 heartbeat timeout', or 'The following tasks
  # are unhealthy (stopped sending heartbeats):' followed by the list, depending on timing.
  assert re.search(r'Task 1 heartbeat timeout|stopped sending heartbeats\):\s*1\b', output)
  assert stop_seconds < 60, stop_seconds  # Heartbeat timeout 5 s; measured about 10 s.
  print(f'process 0 stopped {stop_seconds:.2f} s after process 1 was killed')


def test_processes_that_never_start_are_named_within_the_heartbeat_timeout(tmp_path):
  """Processes 0 and 1 of 3 start, 2 never does; and a process 1 whose process 0 never starts."""
  from launch.local import free_port, process_env
  base = dict(os.environ)

  def start(index, of, port):
    return subprocess.Popen(
        [sys.executable, '-m', 'engine.main', '--heartbeat_timeout_s=3',
         '--config=tests/support/multihost_experiment.py', f'--workdir={tmp_path / str(port)}'],
        cwd=ROOT, env=process_env(base, index, of, 1, port), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)

  three, alone = free_port(), free_port()
  started = time.monotonic()
  procs = [start(0, 3, three), start(1, 3, three), start(1, 2, alone)]
  outputs = [p.communicate(timeout=120)[0] for p in procs]
  seconds = time.monotonic() - started
  assert [p.returncode for p in procs] == [1, 1, 1], outputs
  assert 'error: process 2 of 3 did not start within 3 s' in outputs[0], outputs[0][-2000:]
  assert 'error: process 2 of 3 did not start within 3 s' in outputs[1], outputs[1][-2000:]
  assert 'error: process 0 (the coordinator, 127.0.0.1:' in outputs[2], outputs[2][-2000:]
  assert all('Traceback' not in out for out in outputs)
  assert seconds < 60, seconds  # The timeout plus the start-up; not JAX's 120 s and an abort.
  print(f'all three stopped {seconds:.1f} s after they were started')


def _logged_steps(workdir) -> int:
  path = os.path.join(workdir, 'metrics.jsonl')
  return len(_logged_losses(workdir)) if os.path.exists(path) else 0


@pytest.mark.parametrize('processes', [1, 2])
def test_sigterm_checkpoints_the_current_step_and_exits_0(processes, reference, tmp_path):
  arg = 'mode=manual,steps=100000,checkpoint_every=100000'
  if processes == 1:
    run = subprocess.Popen(
        [sys.executable, '-m', 'engine.main',
         f'--config=tests/support/multihost_experiment.py:{arg}',
         f'--workdir={tmp_path}'], cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
  else:
    run = _launch(2, 4, arg, tmp_path, background=True)
  deadline = time.monotonic() + 300
  while _logged_steps(tmp_path) < 3:
    assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()[-4000:]
    time.sleep(0.1)
  signalled = time.monotonic()
  run.send_signal(signal.SIGTERM)
  output, _ = run.communicate(timeout=200)
  print(f'{processes} process(es) exited {time.monotonic() - signalled:.2f} s after SIGTERM')
  assert run.returncode == 0, output[-4000:]
  assert 'Rerun the same command to resume' in output, output[-4000:]  # Process 0 logs it.
  stopped = latest_complete_step(str(tmp_path / 'checkpoints'))
  assert sorted(_logged_losses(tmp_path)) == list(range(1, stopped + 1))
  summary = json.loads((tmp_path / 'summary.json').read_text())
  assert (summary['status'], summary['final_step']) == ('preempted', stopped), summary
  # The rerun continues as if nothing had happened.
  resumed = train(multihost_experiment.get_config(f'steps={stopped + 2}'), str(tmp_path))
  assert sorted(resumed.train_losses) == [stopped + 1, stopped + 2]
  assert (resumed.summary['status'], resumed.summary['final_step']) == ('finished', stopped + 2)
  # Every logged loss, before the signal and after the rerun, is the single-device run's.
  if stopped + 2 > REFERENCE_STEPS:
    reference = single_device_run(multihost_experiment.get_config(f'steps={stopped + 2}'),
                                  stopped + 2)
  logged = _logged_losses(tmp_path)
  np.testing.assert_allclose([logged[s] for s in range(1, stopped + 3)],
                             reference.losses[:stopped + 2], atol=ATOL, rtol=0)


def _launch_faulty(processes, devices, arg, workdir, *flags):
  """launch.local of tests/support/fault_experiment.py; returns (exit status, output)."""
  command = [sys.executable, '-m', 'launch.local', f'--num_processes={processes}',
             f'--devices_per_process={devices}', '--', sys.executable, '-m', 'engine.main',
             '--heartbeat_timeout_s=60', f'--config=tests/support/fault_experiment.py:{arg}',
             f'--workdir={workdir}', *flags]
  proc = subprocess.run(command, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True,
                        timeout=600)
  return proc.returncode, proc.stdout + proc.stderr


def test_a_run_resumes_from_the_local_tier_or_without_it_from_the_workdir(reference, tmp_path):
  """2 processes, local checkpoints every step, the workdir's every 4. A run whose data stops
  after step 6 (the watchdog ends it) resumes from the local tier's step 6; stopped again after
  step 10, with process 1's local tier deleted (a replaced host), from the workdir's step 8. The
  losses are the single-device run's throughout."""
  workdir, local = tmp_path / 'run', tmp_path / 'local'
  flags = [f'--config.train.local_checkpoint_dir={local}',
           '--config.train.local_checkpoint_every=1', '--config.train.hang_timeout_s=3']
  code, output = _launch_faulty(2, 4, 'process=0,hang_after=6,steps=12,checkpoint_every=4',
                                workdir, *flags)
  assert code != 0 and 'made no progress for 3 s' in output, output[-4000:]
  assert latest_complete_step(workdir / 'checkpoints') == 4
  code, output = _launch_faulty(2, 4, 'process=0,hang_after=4,steps=12,checkpoint_every=4',
                                workdir, *flags)
  assert code != 0 and "Resuming from step 6 of the local tier" in output, output[-4000:]
  assert latest_complete_step(workdir / 'checkpoints') == 8
  lost, = local.glob('*/*/process_1')
  shutil.rmtree(lost)
  code, output = _launch_faulty(2, 4, 'steps=12,checkpoint_every=4', workdir, *flags)
  assert code == 0, output[-4000:]
  assert ("Resuming from the workdir's checkpoint of step 8: the local tier's step 10 is not on "
          'process 1 (its local checkpoints are missing or damaged') in output, output[-4000:]
  # Step 6's line was still pending (a step is logged once the next is dispatched) when the
  # first run was ended, and the local tier's step 6 is not trained again.
  assert 6 not in _logged_losses(workdir)
  _assert_logged_match(workdir, [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12], reference)
