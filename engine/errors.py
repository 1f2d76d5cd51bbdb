"""The errors the engine explains in one line: bad input, and checkpoints that cannot be written
or resumed. They live apart from the code that raises them, so that a command's line reader, the
data pipeline and the validation can name them without importing Orbax or JAX."""

from __future__ import annotations

import errno
import os


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key and the fix."""


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, or the one to resume from is damaged. The message names
  the step, the cause and what to do."""


DISK_FULL = 'the file system is full (No space left on device)'


# Less free space than this where a write just failed: the disk is full, whatever the error said.
NEARLY_FULL_BYTES = 1 << 20


def is_disk_full(error: BaseException, directory: str | None = None) -> bool:
  """Whether `error` says the disk (or the quota) is full: an OSError, or the message of
  tensorstore's RESOURCE_EXHAUSTED that wraps one. With `directory` (a local path), also whether
  its file system has under NEARLY_FULL_BYTES free: a write cut short on a full disk can surface
  as another error (tensorstore reading back a truncated file says NOT_FOUND)."""
  if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
    return True
  text = str(error)
  if any(sign in text for sign in ('No space left on device', 'Disk quota exceeded',
                                   "os_error_code='28'")):
    return True
  return directory is not None and _free_bytes(directory) < NEARLY_FULL_BYTES


def _free_bytes(directory: str) -> float:
  """Free bytes for an unprivileged writer on `directory`'s file system; infinite where that
  cannot be read (a bucket, a path that is gone)."""
  try:
    stat = os.statvfs(directory)
  except (OSError, ValueError):
    return float('inf')
  return stat.f_bavail * stat.f_frsize
