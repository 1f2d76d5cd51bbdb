"""Multi-process start-up: jax.distributed from flags, environment, or cluster auto-detection.

One program runs on every process (JAX's multi-controller model). Where the coordinates come
from, in order:
  1. explicit values (the --coordinator_address / --num_processes / --process_id flags);
  2. the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (what
     launch/local.py sets);
  3. a cluster JAX detects by itself: a Cloud TPU VM (single or multi-host), a SLURM job, ...
Otherwise the run is single-process and nothing is initialised. On CPU the cross-process collectives
use gloo. A process that stops sending heartbeats for `heartbeat_timeout_s` is declared dead and the
others stop with an error instead of waiting forever. With an explicit coordinator, a roll call
(engine/distributed/roll_call.py) first names the processes that never started.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import time

import jax
from absl import logging

from engine.cli.argv import fail
# PeerMissingError: callers catch it here.
from engine.distributed.roll_call import PeerMissingError, await_peers  # noqa: F401


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = 30
  initialization_timeout_s: int = 120


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None:
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f'{name}={value!r} (environment) is not an integer; set it to one, or unset '
                     'it.') from None


def _from_environment(options: DistributedOptions) -> DistributedOptions:
  return dataclasses.replace(
      options,
      coordinator_address=(options.coordinator_address or
                           os.environ.get('JAX_COORDINATOR_ADDRESS')),
      num_processes=(options.num_processes if options.num_processes is not None else
                     _env_int('JAX_NUM_PROCESSES')),
      process_id=(options.process_id if options.process_id is not None else
                  _env_int('JAX_PROCESS_ID')))


def _check(options: DistributedOptions) -> None:
  """Raises ValueError, naming the flag and the fix, for process settings that cannot work."""
  n, i = options.num_processes, options.process_id
  if n is not None and n < 1:
    raise ValueError(f'--num_processes={n} must be at least 1.')
  if i is not None and i < 0:
    raise ValueError(f'--process_id={i} must be >= 0: processes are numbered from 0.')
  if i is not None and n is not None and i >= n:
    raise ValueError(f'--process_id={i} must be below --num_processes={n}: processes are '
                     f'numbered 0 to {n - 1}.')
  if options.heartbeat_timeout_s < 1:
    raise ValueError(f'--heartbeat_timeout_s={options.heartbeat_timeout_s} must be at least 1 '
                     '(seconds).')


def detected_cluster() -> str | None:
  """The cluster JAX can set itself up in (a Cloud TPU VM, a SLURM job, GKE, ...), if any.

  Uses JAX's own cluster detectors, the ones `jax.distributed.initialize()` consults; they are
  not public API, so any failure to reach them means "no cluster"."""
  try:
    from jax._src.clusters import ClusterEnv
    for env in ClusterEnv._cluster_types:  # pylint: disable=protected-access
      if not env.opt_in_only_method and env.is_env_present():
        return env.name
  except Exception:  # noqa: BLE001  (private API: absent or changed means no detection)
    return None
  return None


_ACTIVE: DistributedOptions | None = None  # Set once jax.distributed is up.


def initialize(options: DistributedOptions = DistributedOptions()) -> None:
  """Starts jax.distributed when there is more than one process; a no-op otherwise. Raises
  ValueError for process settings that cannot work."""
  options = _from_environment(options)
  _check(options)
  explicit = options.coordinator_address is not None
  if explicit and (options.num_processes is None or options.process_id is None):
    raise ValueError('--coordinator_address needs --num_processes and --process_id too (or '
                     'JAX_NUM_PROCESSES and JAX_PROCESS_ID).')
  if explicit and options.num_processes == 1:
    return
  cluster = None if explicit else detected_cluster()
  if not explicit and cluster is None:
    if (options.num_processes or 1) > 1:
      raise ValueError(
          f'--num_processes={options.num_processes} asks for several processes, but there is no '
          '--coordinator_address (nor JAX_COORDINATOR_ADDRESS, nor a cluster that provides '
          'one); pass --coordinator_address=HOST:PORT of process 0, or start the processes with '
          'python -m launch.local.')
    return
  if explicit:
    await_peers(options.coordinator_address, options.num_processes, options.process_id,
                options.heartbeat_timeout_s)
  # Harmless where the backend is not the CPU; required for CPU collectives across processes.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    jax.distributed.initialize(
        coordinator_address=options.coordinator_address,
        num_processes=options.num_processes,
        process_id=options.process_id,
        heartbeat_timeout_seconds=options.heartbeat_timeout_s,
        initialization_timeout=options.initialization_timeout_s)
  except OSError as e:  # requests' errors too: a cluster's metadata server out of reach.
    if explicit or (options.num_processes or 1) > 1:
      raise
    # A machine that looks like a cluster's (a TPU VM's devices and variables) but whose
    # metadata server cannot be reached, as on a lone TPU VM kept off the network: one process.
    logging.warning('jax.distributed: the %s cluster\'s settings could not be read (%s); '
                    'running as a single process.', cluster, str(e).splitlines()[0][:200])
    return
  global _ACTIVE
  _ACTIVE = options
  _watch_for_failures()
  logging.info('jax.distributed: process %d of %d (%s), %d local / %d global devices',
               jax.process_index(), jax.process_count(), cluster or 'explicit',
               jax.local_device_count(), jax.device_count())
  if jax.process_index() != 0:
    # One log, one set of metrics: the other processes report only warnings and errors.
    logging.set_verbosity(logging.WARNING)


def is_active() -> bool:
  """Whether this is one process of several (jax.distributed is up)."""
  return _ACTIVE is not None


def heartbeat_timeout_s() -> int:
  return (_ACTIVE or DistributedOptions()).heartbeat_timeout_s


def await_failure_report() -> None:
  """After a collective failed (a peer's connection closed), give the distributed runtime the
  time to notice which process stopped sending heartbeats: it then ends this process with an
  error naming that process. Returns at once in single-process runs."""
  if _ACTIVE is None:
    return
  if _REPORTED.locked():  # A failure is being reported: this process is about to exit.
    time.sleep(_WAIT_FOR_OTHERS_S + 5)
  logging.error('A cross-process collective failed: another process has probably stopped. '
                'Waiting up to %d s for the distributed runtime to name it.',
                _ACTIVE.heartbeat_timeout_s)
  time.sleep(_ACTIVE.heartbeat_timeout_s + 5)


# A process that fails posts its error line under this key of jax.distributed's key-value store
# (kept by process 0, the coordinator); every other process watches for it and stops at once,
# wherever it waits (a collective, an Orbax barrier), instead of waiting for the failed one
# forever. Process 0 leaves last: without it the others' runtime aborts with a fatal log.
_FAILURE_KEY = 'engine/failure'
_SEEN_KEY = 'engine/failure_seen/'
_REPORTED = threading.Lock()  # Held by whichever of the main thread and the watch reports first.
_WAIT_FOR_OTHERS_S = 5.0  # How long process 0 waits for the others to read a report and go.
_OWN_REPORT_S = 4.0  # How long a process given another's bad-input report waits for its own
# (a loaded machine takes seconds to reach the same check; less than process 0 waits for it).


def client():
  """jax.distributed's client of the coordinator's key-value store (None in one process)."""
  from jax._src import distributed as jax_distributed  # The runtime's key-value store.
  return jax_distributed.global_state.client

_EXIT_HOOKS: list = []  # Called (each failure ignored) when a failure ends this process.


def add_exit_hook(hook) -> None:
  """`hook()` runs before a failure reported by any process ends this one (the watchdog writes
  this process's Python stacks)."""
  _EXIT_HOOKS.append(hook)


def _leave(code: int) -> None:
  """Exits at once; a process other than 0 first says it has read the report, process 0 waits
  (bounded) for the others to say so and go. Orbax's and JAX's threads may be blocked in
  barriers that a failed process never reaches: an ordinary exit would wait for them."""
  for hook in _EXIT_HOOKS:
    with contextlib.suppress(Exception):
      hook()
  sys.stdout.flush()
  sys.stderr.flush()
  me, store = jax.process_index(), client()
  if me != 0:
    with contextlib.suppress(Exception):
      store.key_value_set(f'{_SEEN_KEY}{me}', '1')
    os._exit(code)  # pylint: disable=protected-access
  deadline = time.monotonic() + _WAIT_FOR_OTHERS_S
  for other in range(1, jax.process_count()):
    remaining_ms = int(1000 * (deadline - time.monotonic()))
    if remaining_ms > 0:
      with contextlib.suppress(Exception):
        store.blocking_key_value_get(f'{_SEEN_KEY}{other}', remaining_ms)
  time.sleep(0.5)  # Each says so just before it exits.
  os._exit(code)  # pylint: disable=protected-access


def _failure_report() -> tuple[int, int, str] | None:
  """(process, exit status, error line) of the failure a process has reported, or None."""
  with contextlib.suppress(Exception):  # Nothing reported yet, or process 0 is gone.
    index, code, message = client().key_value_try_get(_FAILURE_KEY).split('\n', 2)
    return int(index), int(code), message
  return None


def _wait_for_own_report(seconds: float) -> None:
  """Returns once this process's main thread reports a failure of its own, or after `seconds`."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline and not _REPORTED.locked():
    time.sleep(0.05)


def _watch_for_failures() -> None:
  """Starts the thread that ends this process when another one reports a failure. It waits in
  short slices, so that it is out of the runtime's calls when the interpreter exits."""
  me, stop = jax.process_index(), threading.Event()

  def watch():
    while not stop.is_set():
      try:
        report = client().blocking_key_value_get(_FAILURE_KEY, 500)
      except Exception as error:  # noqa: BLE001
        if 'DEADLINE_EXCEEDED' in str(error):
          continue
        return  # The coordinator has gone: the run is over.
      index, code, message = report.split('\n', 2)
      if int(index) == me:
        return
      if int(code) == 2:  # Bad input, which every process usually finds at once: let this
        _wait_for_own_report(_OWN_REPORT_S)  # one report it in its own words first.
      if _REPORTED.acquire(blocking=False):
        print(f'error: process {index} of {jax.process_count()} failed, so process {me} stops '
              f'too: {message}', file=sys.stderr, flush=True)
        _leave(int(code))
      return

  watcher = threading.Thread(target=watch, name='engine_failure_watch', daemon=True)
  watcher.start()

  def end_watch():  # Before jax.distributed's own exit handler (atexit runs them in reverse).
    stop.set()
    watcher.join(timeout=5)

  atexit.register(end_watch)


def fail_run(message: str, code: int) -> None:
  """Ends this process with `error: message` and exit status `code`; in a multi-process run
  every other process stops too, naming this one and `message`. Never returns."""
  if _ACTIVE is None:
    fail(message, code)
  if not _REPORTED.acquire(blocking=False):
    time.sleep(_WAIT_FOR_OTHERS_S + 5)  # The watch is ending this process for another's failure.
    os._exit(code)  # pylint: disable=protected-access
  earlier = _failure_report()
  # Another process failed first (this one may have been stopped while it did, and finds its own
  # wait too long on waking): the run ends for that failure, as the watch would say. The same
  # failure found by both (bad input every process refuses alike) is this one's too: its line.
  if earlier is not None and earlier[0] != jax.process_index() and earlier[2] != message:
    index, code, first = earlier
    print(f'error: process {index} of {jax.process_count()} failed, so process '
          f'{jax.process_index()} stops too: {first}', file=sys.stderr, flush=True)
    _leave(code)
  print(f'error: {message}', file=sys.stderr, flush=True)
  with contextlib.suppress(Exception):  # Another process reported first, or process 0 is gone.
    client().key_value_set(_FAILURE_KEY, f'{jax.process_index()}\n{code}\n{message}')
  _leave(code)
