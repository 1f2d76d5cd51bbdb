"""Runs one command on every worker of a multi-host Cloud TPU VM (a pod slice).

  python -m launch.tpu_pod --tpu=my-v5e-32 --zone=us-west4-a -- \
      python -m engine.main --config=experiments/shakespeare_char.py:mesh=-1x1x1 \
      --config.data.path=/data/tinyshakespeare.txt --workdir=gs://my-bucket/runs/shakespeare

What it does, in order (print it with --dry_run):
  1. packs the project's git-tracked files (committed or not) into a tarball;
  2. copies it to every worker (`gcloud compute tpus tpu-vm scp ... --worker=all`);
  3. on every worker at once (`gcloud compute tpus tpu-vm ssh ... --worker=all --command ...`):
     unpacks it into --remote_dir, runs --setup (installs the engine and jax[tpu]), then the
     command. engine.distributed finds the pod by itself (JAX's TPU cluster detection), so the
     command is the same as on one machine. Use a gs:// workdir so that all workers share it.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from launch.command import add_command_argument, command_after_dashes

DEFAULT_SETUP = 'python3 -m pip install -q -e . "jax[tpu]>=0.10,<0.11"'
ARCHIVE = '/tmp/engine_code.tgz'


def plan(tpu: str, zone: str, project: str | None, remote_dir: str, setup: str,
         command: list[str]) -> list[list[str]]:
  """The commands that sync the code and start it on all workers, in order."""
  where = ['--zone', zone, '--worker=all'] + (['--project', project] if project else [])
  remote = (f'mkdir -p {remote_dir} && tar xzf ~/engine_code.tgz -C {remote_dir} && '
            f'cd {remote_dir} && {setup} && {shlex.join(command)}')
  return [
      ['bash', '-c', f'git ls-files -z | xargs -0 tar czf {ARCHIVE}'],
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', ARCHIVE, f'{tpu}:~/engine_code.tgz',
       *where],
      ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', tpu, *where, '--command', remote],
  ]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--tpu', required=True, help='TPU VM name.')
  parser.add_argument('--zone', required=True)
  parser.add_argument('--project', default=None)
  parser.add_argument('--remote_dir', default='~/engine')
  parser.add_argument('--setup', default=DEFAULT_SETUP,
                      help='Shell command run in remote_dir before the command.')
  parser.add_argument('--dry_run', action='store_true', help='Print the commands; run nothing.')
  add_command_argument(parser)
  args = parser.parse_args(argv)
  command = command_after_dashes(parser, args)
  for step in plan(args.tpu, args.zone, args.project, args.remote_dir, args.setup, command):
    print(shlex.join(step), flush=True)
    if not args.dry_run:
      result = subprocess.run(step)
      if result.returncode:
        print(f'[tpu_pod] failed with status {result.returncode}: {shlex.join(step)}',
              file=sys.stderr)
        return result.returncode
  return 0


if __name__ == '__main__':
  sys.exit(main())
