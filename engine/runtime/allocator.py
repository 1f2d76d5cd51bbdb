"""Host process settings that decide CPU step time, applied when `engine` is imported.

XLA:CPU allocates every temporary buffer of a step afresh and frees it at the end. With glibc's
defaults each worker thread allocates from its own arena, an arena that empties is unmapped, and
the next step page-faults all of that memory back in as kernel time. Keeping freed memory
mapped (a high trim and mmap threshold, two arenas) removes it; one arena serialises the eight
threads of a simulated 8-device mesh on its lock, and two were fastest for both (`python -m
engine.bench`; the figures: docs/benchmarks.md, "Shakespeare-char on CPU against PyTorch").

The price: XLA's multi-threaded compiles are slower with two arenas, a one-time cost against
every step's. Set ENGINE_TUNE_MALLOC=0 to keep glibc's defaults (tests/conftest.py does).
Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from absl import logging

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_KEEP_MAPPED_BYTES = 1 << 30
_ARENAS = 2


def tune_malloc() -> bool:
  """Applies the allocator settings above to this process; True where they took effect. Only
  threads that have not allocated yet follow them: engine/__init__.py calls this first."""
  if os.environ.get('ENGINE_TUNE_MALLOC', '1') == '0':
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')
    mallopt = libc.mallopt
  except (OSError, AttributeError):  # Not glibc (macOS, musl): nothing to tune.
    return False
  done = all(mallopt(option, value) == 1 for option, value in (
      (_M_ARENA_MAX, _ARENAS), (_M_MMAP_THRESHOLD, _KEEP_MAPPED_BYTES),
      (_M_TRIM_THRESHOLD, _KEEP_MAPPED_BYTES)))
  if not done:
    logging.warning('glibc refused the allocator settings of engine.runtime.allocator; CPU steps '
                    'may be slower (page faults).')
  return done
