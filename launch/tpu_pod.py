"""Runs one command on every worker of a multi-host Cloud TPU VM (a pod slice).

  python -m launch.tpu_pod --tpu=my-v5e-32 --zone=us-west4-a -- \
      python -m engine.main --config=experiments/shakespeare_char.py:mesh=-1x1x1 \
      --config.data.path=/data/tinyshakespeare.txt --workdir=gs://my-bucket/runs/shakespeare

What it does, in order (print it with --dry_run):
  1. packs the project's git-tracked files, as they are on disk (changes committed or not),
     into a tarball, with the command's experiment file (`--config=FILE`) if git does not track
     it; run it from the project root;
  2. copies it to every worker (`gcloud compute tpus tpu-vm scp ... --worker=all`);
  3. on every worker at once (`gcloud compute tpus tpu-vm ssh ... --worker=all --command ...`):
     unpacks it into --remote_dir, installs the engine with the extras the run needs
     (`pip install -e ".[tpu]"`, `.[tpu,gcs]` when the command names a gs:// path), runs
     --setup if given (after the install, not instead of it), then the command.
     engine.distributed finds the pod by itself (JAX's TPU cluster detection), so the command is
     the same as on one machine. Use a gs:// workdir so that all workers share it.

Stopping: SIGTERM or Ctrl-C to this launcher while the command runs sends SIGTERM to the
command on every worker (another `ssh --worker=all`, running pkill): each process finishes its
step, checkpoints it and exits 0 (engine/train/preemption.py); whatever still runs after
--stop_grace_s is left to the ssh session's end. A preempted or maintained TPU VM is handled on
the workers themselves by JAX's preemption service.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

from engine.cli.argv import flag_value
from launch.command import (Parser, add_command_argument, check_at_least, check_tool,
                            command_after_dashes, fail)

ARCHIVE = '/tmp/engine_code.tgz'
_EXAMPLE = {'tpu': '--tpu=my-v5e-32', 'zone': '--zone=us-west4-a',
            'remote_dir': '--remote_dir=~/engine'}


def install_command(command: list[str]) -> str:
  """Installs the engine with the extras (setup.cfg) the run needs: `tpu` (jax[tpu]) always,
  `gcs` when the command names a gs:// path (workdir or data)."""
  extras = ['tpu'] + (['gcs'] if any('gs://' in arg for arg in command) else [])
  return f'python3 -m pip install -q -e ".[{",".join(extras)}]"'


def experiment_file(command: list[str]) -> str | None:
  """The command's experiment file (`--config=FILE[:ARG]`) when git does not track it: it is
  shipped along with the tracked files. None when there is none or git tracks it (a tracked
  file is shipped as it is on disk, changes and all). Refused when it is outside the project."""
  given = flag_value(command, 'config')
  if not given:
    return None
  path = given.partition(':')[0]
  if not os.path.isfile(path):
    fail(f'--config={given} (in the command) is not a file here; run the launcher from the '
         'project root, or fix the path.')
  relative = os.path.relpath(path)
  if relative.startswith('..') or os.path.isabs(path):
    fail(f'--config={given} (in the command) lies outside the project, and only the project is '
         f'shipped to the workers; copy it into the project, e.g. experiments/'
         f'{os.path.basename(path)}, and give that path.')
  tracked = subprocess.run(['git', 'ls-files', '--error-unmatch', relative],
                           capture_output=True).returncode == 0
  return None if tracked else relative


def plan(tpu: str, zone: str, project: str | None, remote_dir: str, setup: str,
         command: list[str], extra_file: str | None = None) -> list[list[str]]:
  """The commands that sync the code and start it on all workers, in order: the tracked files
  (and `extra_file`), the install (and `setup` after it), then the command."""
  where = ['--zone', zone, '--worker=all'] + (['--project', project] if project else [])
  install = install_command(command) + (f' && {setup}' if setup else '')
  remote = (f'mkdir -p {remote_dir} && tar xzf ~/engine_code.tgz -C {remote_dir} && '
            f'cd {remote_dir} && {install} && {shlex.join(command)}')
  files = 'git ls-files -z'
  if extra_file:
    files = f"{{ {files}; printf '%s\\0' {shlex.quote(extra_file)}; }}"
  return [
      ['bash', '-c', f'{files} | xargs -0 tar czf {ARCHIVE}'],
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', ARCHIVE, f'{tpu}:~/engine_code.tgz',
       *where],
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', tpu, *where, '--command', remote],
  ]


def stop_command(tpu: str, zone: str, project: str | None, command: list[str]) -> list[str]:
  """The command that sends SIGTERM to `command` on every worker."""
  where = ['--zone', zone, '--worker=all'] + (['--project', project] if project else [])
  pattern = shlex.quote(re.escape(' '.join(command)))
  return ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', tpu, *where, '--command',
          f'pkill -TERM -f -- {pattern} || true']


def _run_forwarding_stops(step: list[str], stop: list[str], grace_s: float) -> int:
  """Runs `step`; on SIGTERM / SIGINT, runs `stop` and gives `step` `grace_s` to end."""
  proc = subprocess.Popen(step)

  def forward(signum, frame):
    del frame
    print(f'[tpu_pod] signal {signum}: asking every worker to checkpoint and stop', flush=True)
    subprocess.run(stop, check=False)
    try:
      proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
      proc.terminate()

  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    return proc.wait()
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def main(argv=None) -> int:
  parser = Parser('launch.tpu_pod', __doc__.split('\n\n')[0])
  parser.add_argument('--tpu', required=True, help='TPU VM name.')
  parser.add_argument('--zone', required=True)
  parser.add_argument('--project', default=None)
  parser.add_argument('--remote_dir', default='~/engine')
  parser.add_argument('--setup', default='',
                      help='Shell command run in remote_dir after the install (pip install -e '
                      '".[tpu]", plus gcs for gs:// paths) and before the command.')
  parser.add_argument('--stop_grace_s', type=float, default=120,
                      help='After forwarding SIGTERM / Ctrl-C, how long the workers get to '
                      'checkpoint and stop.')
  parser.add_argument('--dry_run', action='store_true', help='Print the commands; run nothing.')
  add_command_argument(parser)
  args = parser.parse_args(argv)
  command = command_after_dashes(args)
  for name in ('tpu', 'zone', 'remote_dir'):
    if not getattr(args, name).strip():
      fail(f'--{name} is empty; give one, e.g. {_EXAMPLE[name]}.')
  check_at_least(args, 0, 'stop_grace_s')
  if not args.dry_run:
    check_tool('gcloud', 'install the Google Cloud CLI (cloud.google.com/sdk) and log in')
  steps = plan(args.tpu, args.zone, args.project, args.remote_dir, args.setup, command,
               experiment_file(command))
  stop = stop_command(args.tpu, args.zone, args.project, command)
  for i, step in enumerate(steps):
    print(shlex.join(step), flush=True)
    if args.dry_run:
      continue
    if i == len(steps) - 1:  # The command itself: stops are forwarded to the workers.
      code = _run_forwarding_stops(step, stop, args.stop_grace_s)
    else:
      code = subprocess.run(step).returncode
    if code:
      print(f'[tpu_pod] failed with status {code}: {shlex.join(step)}', file=sys.stderr)
      return code
  if args.dry_run:
    print(f'# on SIGTERM / Ctrl-C: {shlex.join(stop)}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
