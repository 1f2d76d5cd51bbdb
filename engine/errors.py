"""The errors the engine explains in one line: bad input, and checkpoints that cannot be written
or resumed. They live apart from the code that raises them, so that a command's line reader, the
data pipeline and the validation can name them without importing Orbax or JAX."""

from __future__ import annotations

import errno


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key and the fix."""


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, or the one to resume from is damaged. The message names
  the step, the cause and what to do."""


DISK_FULL = 'the file system is full (No space left on device)'


def is_disk_full(error: BaseException) -> bool:
  """Whether `error` says the disk (or the quota) is full: an OSError, or the message of
  tensorstore's RESOURCE_EXHAUSTED that wraps one."""
  if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
    return True
  text = str(error)
  return any(sign in text for sign in ('No space left on device', 'Disk quota exceeded',
                                       "os_error_code='28'"))
