"""Submits one command as a SLURM batch job on a GPU cluster: one task per GPU or per host.

  python -m launch.slurm --nodes=4 --gpus_per_node=8 --time=02:00:00 --partition=gpu -- \
      python -m engine.main --config=experiments/shakespeare_char.py:mesh=-1x1x1 \
      --config.data.path=/shared/tinyshakespeare.txt --workdir=/shared/runs/shakespeare

It writes a batch script (`--script`, default ./engine_job.sbatch) and runs `sbatch` on it;
`--dry_run` prints the script and the sbatch command instead. Inside the job, `srun` starts the
tasks and engine.distributed lets JAX's SLURM detection find the coordinator, the process count
and each process's index. `--kill-on-bad-exit=1` makes srun stop every task when one fails.
SLURM sends every task SIGTERM `--stop_grace_s` before the time limit (and when the job is
preempted or cancelled, with the cluster's KillWait before SIGKILL): each finishes its step,
checkpoints and exits 0; with `--requeue` a preempted job is requeued and resumes from there.

--tasks=per_gpu (default) runs one process per GPU (each sees its own GPU); --tasks=per_host runs
one process per node that drives all of its GPUs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from launch.command import (Parser, add_command_argument, check_at_least, check_tool,
                            command_after_dashes, fail)
from launch.experiment import check_job_fits_mesh

# SLURM's time limit formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_TIME = re.compile(r'^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$')


def batch_script(command: list[str], nodes: int, gpus_per_node: int, tasks: str,
                 time_limit: str, partition: str | None, job_name: str, setup: str,
                 stop_grace_s: int = 120, requeue: bool = False) -> str:
  per_gpu = tasks == 'per_gpu'
  lines = [
      '#!/bin/bash',
      f'#SBATCH --job-name={job_name}',
      f'#SBATCH --nodes={nodes}',
      f'#SBATCH --ntasks-per-node={gpus_per_node if per_gpu else 1}',
      f'#SBATCH --gpus-per-node={gpus_per_node}',
  ]
  if per_gpu:
    lines.append('#SBATCH --gpus-per-task=1')  # Each process sees only its own GPU.
  lines += [f'#SBATCH --time={time_limit}', f'#SBATCH --output={job_name}-%j.out',
            # SIGTERM to every task this long before the time limit: each finishes its step,
            # checkpoints it and exits 0 (engine/train/preemption.py).
            f'#SBATCH --signal=TERM@{stop_grace_s}']
  if requeue:  # A preempted or timed-out job goes back in the queue and resumes from there.
    lines += ['#SBATCH --requeue', '#SBATCH --open-mode=append']
  if partition:
    lines.append(f'#SBATCH --partition={partition}')
  lines += ['', 'set -euo pipefail']
  if setup:
    lines.append(setup)
  lines += ['srun --kill-on-bad-exit=1 ' + shlex.join(command), '']
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = Parser('launch.slurm', __doc__.split('\n\n')[0])
  parser.add_argument('--nodes', type=int, required=True)
  parser.add_argument('--gpus_per_node', type=int, default=8)
  parser.add_argument('--tasks', choices=('per_gpu', 'per_host'), default='per_gpu')
  parser.add_argument('--time', default='01:00:00', help='Time limit, HH:MM:SS.')
  parser.add_argument('--partition', default=None)
  parser.add_argument('--job_name', default='engine')
  parser.add_argument('--setup', default='',
                      help='Shell line run before srun, e.g. "source .venv/bin/activate".')
  parser.add_argument('--script', default='engine_job.sbatch', help='Where to write the script.')
  parser.add_argument('--stop_grace_s', type=int, default=120,
                      help='SIGTERM the tasks this many seconds before the time limit, so they '
                      'checkpoint and stop.')
  parser.add_argument('--requeue', action='store_true',
                      help='Requeue the job when it is preempted; the rerun resumes.')
  parser.add_argument('--dry_run', action='store_true', help='Print; write and submit nothing.')
  add_command_argument(parser)
  args = parser.parse_args(argv)
  command = command_after_dashes(args)
  check_at_least(args, 1, 'nodes', 'gpus_per_node')
  check_at_least(args, 0, 'stop_grace_s')
  if not _TIME.match(args.time):
    fail(f'--time={args.time} is not a SLURM time limit; write MINUTES, HH:MM:SS or '
         'DAYS-HH:MM:SS, e.g. --time=02:00:00.')
  per_gpu = args.tasks == 'per_gpu'
  check_job_fits_mesh(command, args.nodes * (args.gpus_per_node if per_gpu else 1),
                      1 if per_gpu else args.gpus_per_node,
                      f'--nodes={args.nodes} x --gpus_per_node={args.gpus_per_node}, '
                      f'--tasks={args.tasks}')
  if not args.dry_run:
    check_tool('sbatch', 'submit from a SLURM login node')
    directory = os.path.dirname(os.path.abspath(args.script))
    if not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
      fail(f'--script={args.script}: {directory} is not a directory this process can write; '
           'pass a path in one.')
  script = batch_script(command, args.nodes, args.gpus_per_node, args.tasks, args.time,
                        args.partition, args.job_name, args.setup, args.stop_grace_s,
                        args.requeue)
  submit = ['sbatch', args.script]
  if args.dry_run:
    print(f'# {args.script}\n{script}')
    print(shlex.join(submit))
    return 0
  with open(args.script, 'w') as f:
    f.write(script)
  print(shlex.join(submit), flush=True)
  return subprocess.run(submit).returncode


if __name__ == '__main__':
  sys.exit(main())
