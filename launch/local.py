"""Runs one command as N cooperating JAX processes on this machine, each with K CPU devices.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- \
      python -m engine.main --config=experiments/tiny.py:mesh=2x2x2,steps=100 \
      --workdir=/tmp/tiny_2x4

Each process gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (read by
engine.distributed), ENGINE_RUN_TOKEN (a fresh random secret per launch, the same for all: the
start-up roll call admits only its holders, engine/distributed/roll_call.py) and XLA_FLAGS for K
simulated devices. Their output is streamed with a `[pI]` prefix, less Gloo's connection notices
(GlooFilter). If any process fails, the others are stopped (SIGTERM, then SIGKILL after
--grace_s: JAX traps SIGTERM as a preemption notice, so a process blocked in a collective only
goes at the SIGKILL) and the launcher exits with that process's status, naming it. SIGTERM or
Ctrl-C to the launcher is forwarded to every process as SIGTERM: each finishes its step, writes
a checkpoint of it and exits 0 (engine/train/preemption.py); what is still running after
--stop_grace_s is killed.

It is for trying multi-process behaviour, not for speed: the collectives between processes run
on the CPU through Gloo (TCP), and steps run in lockstep (engine/train/loop.py), so expect several
times less throughput than one process with the same devices.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from launch.command import (Parser, add_command_argument, check_at_least, check_program,
                            command_after_dashes, fail)


def free_port() -> int:
  """A free port whose next port is free too (engine.distributed's start-up roll call)."""
  while True:
    with socket.socket() as s, socket.socket() as after:
      s.bind(('127.0.0.1', 0))
      port = s.getsockname()[1]
      try:
        after.bind(('127.0.0.1', port + 1))
      except OSError:
        continue
      return port


def process_env(base: dict, index: int, num_processes: int, devices: int, port: int,
                token: str | None = None) -> dict:
  env = dict(base)
  env.update(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_NUM_PROCESSES=str(num_processes),
             JAX_PROCESS_ID=str(index), JAX_PLATFORMS='cpu')
  if token:
    env['ENGINE_RUN_TOKEN'] = token
  flags = [f for f in env.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  env['XLA_FLAGS'] = ' '.join(flags + [f'--xla_force_host_platform_device_count={devices}'])
  return env


# Gloo (JAX's CPU collectives across processes) prints a line for every communicator it sets up,
# e.g. `[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1`:
# dozens per launch, all saying that the processes found each other. Only lines made of nothing
# but such messages are dropped. Two threads writing at once can put two messages on one line and
# leave the second one's newline as an empty line later; that many empty lines are dropped too.
_GLOO = re.compile(r'(\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. Expected number of '
                   r'connected peer ranks is : \d+)+')


class GlooFilter:
  """Which lines of one process's output to show: all but Gloo's connection notices."""

  def __init__(self):
    self.stray_newlines = 0  # Newlines still owed by messages that shared a line.

  def keep(self, line: str) -> bool:
    text = line.rstrip('\r\n')
    if _GLOO.fullmatch(text):
      self.stray_newlines += text.count('[Gloo]') - 1
      return False
    if not text and self.stray_newlines:
      self.stray_newlines -= 1
      return False
    return True


def _stream(index: int, pipe) -> None:
  shown = GlooFilter()
  for line in iter(pipe.readline, ''):
    if shown.keep(line):
      sys.stdout.write(f'[p{index}] {line}')
      sys.stdout.flush()


def _describe(code: int) -> str:
  return f'was killed by signal {-code}' if code < 0 else f'exited with status {code}'


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM to every live process group, then SIGKILL to what is left after `grace_s`."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
      time.sleep(0.05)


def launch(command: list[str], num_processes: int, devices_per_process: int,
           grace_s: float = 3.0, port: int | None = None, stop_grace_s: float = 120.0) -> int:
  """Runs the processes to completion; returns 0, or the failing process's status."""
  port = port or free_port()
  token = secrets.token_hex(32)  # Only this launch's processes pass the roll call.
  procs, threads = [], []
  for i in range(num_processes):
    proc = subprocess.Popen(
        command, env=process_env(os.environ, i, num_processes, devices_per_process, port, token),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # Its own process group, so stopping it stops its children.
    procs.append(proc)
    threads.append(threading.Thread(target=_stream, args=(i, proc.stdout), daemon=True))
    threads[-1].start()

  def interrupted(signum, frame):
    # Preemption or Ctrl-C: every process gets SIGTERM, finishes its step, checkpoints and
    # exits; only what is still running after `stop_grace_s` is killed.
    del frame
    print(f'[launch] signal {signum}: asking all {num_processes} processes to checkpoint and '
          f'stop (SIGTERM; SIGKILL after {stop_grace_s:g} s)', flush=True)
    _stop(procs, stop_grace_s)
    for t in threads:
      t.join(timeout=1)
    codes = [p.returncode for p in procs]
    failed = [(i, code) for i, code in enumerate(codes) if code != 0]
    for i, code in failed:
      print(f'[launch] process {i} {_describe(code)}', flush=True)
    sys.exit(0 if not failed else 128 + signum)

  previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while True:
      failed = [(i, p.returncode) for i, p in enumerate(procs)
                if p.poll() is not None and p.returncode != 0]
      if failed:
        index, code = failed[0]
        print(f'[launch] process {index} {_describe(code)}; stopping the other processes',
              flush=True)
        _stop(procs, grace_s)
        for t in threads:
          t.join(timeout=1)
        return code if code > 0 else 128 - code
      if all(p.poll() is not None for p in procs):
        for t in threads:
          t.join(timeout=1)
        return 0
      time.sleep(0.05)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def main(argv=None) -> int:
  parser = Parser('launch.local', __doc__.split('\n\n')[0])
  parser.add_argument('--num_processes', type=int, required=True)
  parser.add_argument('--devices_per_process', type=int, default=1)
  parser.add_argument('--grace_s', type=float, default=3.0,
                      help='Seconds between SIGTERM and SIGKILL when stopping processes.')
  parser.add_argument('--stop_grace_s', type=float, default=120.0,
                      help='When the launcher gets SIGTERM / SIGINT: seconds the processes have '
                      'to checkpoint and exit before SIGKILL.')
  parser.add_argument('--port', type=int, default=None, help='Coordinator port (default: free).')
  add_command_argument(parser)
  args = parser.parse_args(argv)
  check_at_least(args, 1, 'num_processes', 'devices_per_process')
  check_at_least(args, 0, 'grace_s', 'stop_grace_s')
  if args.port is not None and not 1024 <= args.port <= 65534:
    fail(f'--port={args.port} must lie in 1024..65534 (the start-up roll call uses the next '
         'port too); or leave it out for a free one.')
  command = command_after_dashes(args)
  check_program(command)
  return launch(command, args.num_processes, args.devices_per_process, args.grace_s, args.port,
                args.stop_grace_s)


if __name__ == '__main__':
  sys.exit(main())
