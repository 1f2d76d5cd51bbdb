"""The processes the tests start: command lines forked from one process that imported the
engine once (`forked`), and the process trees the multi-process tests start (launch.local puts
each process in a session of its own, so killing the launcher's process group would leave them
running)."""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def forked(rows: list[dict], timeout_s: float = 900) -> list[dict]:
  """Each row ({"program", "argv", "cwd", optional "env"}) run as `python -m PROGRAM ARGV` by
  tests/support/forked_commands.py (a fork per row, JAX and the engine imported once), on
  conftest.py's XLA_FLAGS (8 devices): each row's {"code", "output", "compiles", "seconds"}."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, '-m', 'tests.support.forked_commands'], cwd=ROOT, env=env,
                        input=json.dumps(rows), capture_output=True, text=True, timeout=timeout_s)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout)


def descendants(pid: int) -> list[int]:
  """Every descendant of `pid`, from /proc, parents before children."""
  tree, i = [pid], 0
  while i < len(tree):
    for task in glob.glob(f'/proc/{tree[i]}/task/*/children'):
      with contextlib.suppress(OSError):
        tree += [int(child) for child in open(task).read().split()]
    i += 1
  return tree[1:]


def kill_tree(pid: int) -> None:
  """SIGKILL to `pid` and all its descendants, stopped ones woken first."""
  for each in [pid, *descendants(pid)]:
    with contextlib.suppress(ProcessLookupError):
      os.kill(each, signal.SIGCONT)
      os.kill(each, signal.SIGKILL)
