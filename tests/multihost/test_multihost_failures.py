"""A failure on one process of several ends every process, each with one `error:` line.

Two processes through launch/local.py. A full disk: their workdir on a small tmpfs, where the
checkpoint of step 2 fits and the one of step 4 does not (the tiny model's checkpoint takes about
540 KiB of tmpfs pages, measured with `du -sk`; the tmpfs has 800 KiB). Which process's writes
fail first is a race; where only one's did, both waited at Orbax's barriers until the launcher
or Orbax's 20-minute timeout killed them. The second test makes that case certain: files above
30 kB cannot be written by process 1 alone.

The tmpfs is mounted by root, or else inside a user namespace (`unshare --map-root-user
--mount`); where neither is allowed, the test fails saying so. ENGINE_TEST_MOUNT=unshare takes
the namespace path even as root, to check it.
"""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from engine.workdir.checkpoint import latest_complete_step

from engine.errors import is_disk_full
from engine.train.loop import train
from tests.support import multihost_experiment
from tests.support.processes import kill_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT_S = 10
_MOUNT_FAILED = 97  # The wrapper script's status when it cannot mount the tmpfs.


def _wrapped(command: list[str], disk, size_kib: int, keep) -> str:
  """A shell script: mount, run, copy the workdir out (a namespace's mount goes with it),
  unmount, exit with the command's status."""
  quoted = ' '.join(f"'{part}'" for part in command)
  return (f'mount -t tmpfs -o size={size_kib}k tmpfs {disk} || exit {_MOUNT_FAILED}\n'
          f'{quoted}\nstatus=$?\ncp -a {disk}/w {keep}\numount {disk}\nexit $status\n')


def _collect(command, limit_s=240):
  """(exit status, seconds it ran, [(seconds since start, line)]) of `command`; killed (with
  its descendants) after `limit_s`."""
  start = time.monotonic()
  proc = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  timer = threading.Timer(limit_s, kill_tree, (proc.pid,))
  timer.start()
  lines = []
  try:
    for line in proc.stdout:
      lines.append((time.monotonic() - start, line.rstrip('\n')))
    proc.wait()
  finally:
    timer.cancel()
  return proc.returncode, time.monotonic() - start, lines


def _run_on_small_disk(command, disk, size_kib, keep):
  """`_collect` of `command` run with a tmpfs of `size_kib` at `disk`."""
  script = _wrapped(command, disk, size_kib, keep)
  ways = [['sh', '-c', script], ['unshare', '--map-root-user', '--mount', 'sh', '-c', script]]
  if os.environ.get('ENGINE_TEST_MOUNT') == 'unshare':
    ways = ways[1:]
  for way in ways:
    result = _collect(way)
    if result[0] != _MOUNT_FAILED:
      return result
  pytest.fail('cannot mount a tmpfs here: `mount -t tmpfs` is not permitted and neither is '
              '`unshare --map-root-user --mount` (user namespaces); run as root or allow user '
              'namespaces (sysctl kernel.unprivileged_userns_clone=1).')


def _launcher(workdir, wrapper=()):
  return [sys.executable, '-m', 'launch.local', '--num_processes=2', '--devices_per_process=4',
          '--', *wrapper, sys.executable, '-m', 'engine.main',
          f'--heartbeat_timeout_s={HEARTBEAT_S}',
          '--config=tests/support/multihost_experiment.py:steps=8,checkpoint_every=2',
          f'--workdir={workdir}']


def _check_both_stopped(status, stopped, lines, cause):
  """Both processes stopped, each with one `error:` line naming `cause`, no traceback, soon
  after the first error line."""
  output = '\n'.join(line for _, line in lines)
  assert stopped < 200, f'killed after {stopped:.0f} s: the processes hung\n' + output[-4000:]
  assert status != 0, output[-4000:]
  errors = {}
  for index in (0, 1):
    errors[index] = [line for _, line in lines if line.startswith(f'[p{index}] error:')]
    assert len(errors[index]) == 1, output[-6000:]
    assert cause in errors[index][0], errors[index][0]
  assert 'Traceback' not in output and 'Check failure' not in output, output[-6000:]
  first_error = min(t for t, line in lines if ' error:' in line)
  print(f'the launcher exited {stopped - first_error:.1f} s after the first error line '
        f'({stopped:.0f} s in all)')
  assert stopped - first_error < HEARTBEAT_S + 5, output[-4000:]  # Measured: under a second.
  return errors[0][0], errors[1][0]


@pytest.mark.slow
def test_a_full_disk_during_a_2_process_save_stops_both_with_one_error_each(tmp_path):
  disk, keep = tmp_path / 'disk', tmp_path / 'kept'
  disk.mkdir()
  try:
    result = _run_on_small_disk(_launcher(f'{disk}/w'), disk, 800, keep)
  finally:
    if os.path.ismount(disk):
      subprocess.run(['umount', str(disk)], check=False)
  for error in _check_both_stopped(*result, 'the file system is full (No space left on device)'):
    # Usually the save reports it; a metrics line that hits the full disk first reads
    # `--workdir=DIR: the file system is full ...`.
    assert 'newest complete checkpoint is step 2' in error or '--workdir=' in error, error
  # The checkpoint of step 2 is intact and a rerun resumes from it.
  assert latest_complete_step(str(keep / 'checkpoints')) == 2
  resumed = train(multihost_experiment.get_config('steps=3'), str(keep))
  assert sorted(resumed.train_losses) == [3]


def test_a_full_disk_is_recognised_in_each_form():
  assert is_disk_full(OSError(errno.ENOSPC, 'No space left on device'))
  assert is_disk_full(ValueError('RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database: Failed '
                                 "to write 230 bytes to file 40: No space left on device "
                                 "[os_error_code='28']"))
  assert not is_disk_full(OSError(errno.EFBIG, 'File too large'))


def test_a_write_cut_short_on_a_full_disk_is_recognised_by_the_free_space(tmp_path, monkeypatch):
  # What tensorstore said once when the disk filled during a save: a read of the cut file.
  cut_short = ValueError('NOT_FOUND: Error writing "x/4" in OCDBT database: Error reading Byte '
                         'range [24711, 27228) of local file "d/dd72"')
  assert not is_disk_full(cut_short, str(tmp_path))
  full = os.statvfs_result((4096, 4096, 200, 0, 0, 100, 0, 0, 0, 255))
  monkeypatch.setattr(os, 'statvfs', lambda path: full)
  assert is_disk_full(cut_short, str(tmp_path))
  assert not is_disk_full(cut_short)  # No directory to look at: the message alone decides.


# Runs the command after it with files above 30 kB unwritable, on process 1 only (its share of
# a checkpoint is written in files of 50 to 110 kB, measured).
_LIMIT_PROCESS_1 = [
    sys.executable, '-c',
    'import os, resource, signal, sys\n'
    'if os.environ["JAX_PROCESS_ID"] == "1":\n'
    '  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'
    '  resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))\n'
    'os.execvp(sys.argv[1], sys.argv[1:])']


@pytest.mark.slow
def test_a_save_that_fails_on_one_process_only_stops_both(tmp_path):
  """Process 1's write fails, process 0's succeeds: before, process 0 waited at Orbax's barrier
  for process 1, and process 1 at the next one for process 0."""
  result = _collect(_launcher(tmp_path, _LIMIT_PROCESS_1))
  errors = _check_both_stopped(*result, 'Saving the checkpoint of step')
  assert 'File too large' in errors[1] and 'process 1 of 2 failed' in errors[0], errors
