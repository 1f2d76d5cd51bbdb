"""The process trees the multi-process tests start (launch.local puts each process in a session of
its own, so killing the launcher's process group would leave them running)."""

import contextlib
import glob
import os
import signal


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
