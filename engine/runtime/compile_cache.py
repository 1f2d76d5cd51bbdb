"""JAX's persistent compilation cache for a run (train.compile_cache_dir), and what it saved.

A restart of the same run (a preemption, a crash, a resumed job) compiles the same programs
again; with the cache it reads them back instead. `train.compile_cache_dir`:

  ''      WORKDIR/compile_cache (default), unless JAX_COMPILATION_CACHE_DIR (JAX's own setting)
          names a cache already: that one is used as JAX was told to (no size bound, JAX's
          threshold), untouched;
  'none'  no cache;
  a path  a cache shared by runs (local, or gs://... with the gcs extra).

The cache is JAX's (jax.config's jax_compilation_cache_dir), a local one with its size bounded
(MAX_SIZE_BYTES, least recently used entries evicted): then JAX takes a file lock for every
read and write of the directory, so processes and runs may share it (a bucket's objects appear
whole or not at all, and take no lock: unbounded there). Within a run only process 0
writes entries (JAX's rule); every process reads. Every program is cached, however fast it
compiled (JAX's jax_persistent_cache_min_compile_time_secs, 1 s by default, is 0 for the run
unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS sets it): a restart's dozens of small programs
(restoring, sharding, evaluating) add up to seconds. The cache is trusted:
whoever can write to the directory can run code in the run's processes (JAX's warning).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
from absl import logging
from etils import epath


DEFAULT_DIRECTORY = 'compile_cache'  # In the workdir.
OFF = 'none'
MAX_SIZE_BYTES = 16 * 2**30
MIN_TIME_VARIABLE = 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'  # The user's, kept where set.
_HIT = '/jax/compilation_cache/cache_hits'
_SAVED = '/jax/compilation_cache/compile_time_saved_sec'
_COMPILE = '/jax/core/compile/backend_compile_duration'  # One per XLA compile.


def directory(setting: str, workdir: epath.Path) -> str | None:
  """The cache directory `train.compile_cache_dir` names for a run in `workdir` (None: none)."""
  if setting == OFF:
    return None
  if setting:  # Local paths made absolute, URIs (gs://...) as given.
    path = epath.Path(setting)
    return str(path if '://' in setting else path.expanduser().absolute())
  return jax.config.jax_compilation_cache_dir or str(workdir / DEFAULT_DIRECTORY)


@dataclasses.dataclass
class Counts:
  """The programs compiled and read from the cache while it was in use."""
  compiled: int = 0
  compile_s: float = 0.0
  hits: int = 0
  saved_s: float = 0.0

  def record(self) -> dict:
    """summary.json's `compilation`."""
    return {'programs': self.compiled, 'seconds': round(self.compile_s, 3),
            'cache_hits': self.hits, 'saved_s': round(self.saved_s, 3)}

  def describe(self) -> str:
    read = f', {self.hits} of them read from the persistent cache' if self.hits else ''
    return f'{self.compiled} programs in {self.compile_s:.1f} s{read}'


@contextlib.contextmanager
def use(setting: str, workdir: epath.Path):
  """JAX's persistent cache set to `setting`'s directory while the run lasts, then JAX's own
  settings back; yields the Counts of what was compiled and read meanwhile. A cache JAX was
  given already (JAX_COMPILATION_CACHE_DIR) is used as JAX was told to, untouched: its size
  bound and threshold are its owner's (a bound on a directory others write without one would
  evict their entries' missing access times)."""
  keep_jax_own = not setting and jax.config.jax_compilation_cache_dir
  path = directory(setting, workdir)
  names = ('jax_compilation_cache_dir', 'jax_compilation_cache_max_size',
           'jax_enable_compilation_cache', 'jax_persistent_cache_min_compile_time_secs')
  before = {name: getattr(jax.config, name) for name in names}
  counts = Counts()

  def heard(event: str, seconds: float, **kwargs) -> None:
    del kwargs
    if event == _COMPILE:
      counts.compiled += 1
      counts.compile_s += seconds
    elif event == _SAVED:  # JAX's record: whole seconds of compilation, less the read's time.
      counts.hits += 1
      counts.saved_s += max(0.0, seconds)

  if not keep_jax_own:
    # A bucket's objects appear whole or not at all, and its paths take no file lock: unbounded.
    bounded = path and '://' not in path
    _configure(path, MAX_SIZE_BYTES if bounded else -1)
    if path and MIN_TIME_VARIABLE not in os.environ:
      jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  if path:
    logging.info('Compilation cache: %s', path)
  jax.monitoring.register_event_duration_secs_listener(heard)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_duration_listener(heard)
    if not keep_jax_own:
      _configure(before['jax_compilation_cache_dir'], before['jax_compilation_cache_max_size'],
                 before['jax_enable_compilation_cache'])
      jax.config.update('jax_persistent_cache_min_compile_time_secs',
                        before['jax_persistent_cache_min_compile_time_secs'])


def _configure(path: str | None, max_size: int, enabled: bool | None = None) -> None:
  from jax.experimental.compilation_cache import (  # pylint: disable=g-import-not-at-top
      compilation_cache)
  compilation_cache.reset_cache()  # JAX opens its cache once; the next compile reopens it.
  jax.config.update('jax_enable_compilation_cache', bool(path) if enabled is None else enabled)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_compilation_cache_max_size', max_size)
