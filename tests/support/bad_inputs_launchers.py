"""Bad input to the launchers (launch.local, launch.slurm, launch.tpu_pod): the command lines a
user could type, with the exit status and the one `error:` line each gets. Part of
tests/support/bad_inputs_commands.py's COMMAND_ROWS (the same `$T` scratch directory)."""

LAUNCHER_ROWS = {
    'launch.local': [
        ([], 2, 'the following arguments are required: --num_processes; python -m launch.local '
         '--help lists the flags.'),
        (['--num_processes=two', '--', 'true'], 2, "argument --num_processes: invalid int value: "
         "'two'; python -m launch.local --help lists the flags."),
        (['--num_processes=0', '--', 'true'], 2, '--num_processes=0 must be >= 1.'),
        (['--num_processes=1', '--devices_per_process=0', '--', 'true'], 2,
         '--devices_per_process=0 must be >= 1.'),
        (['--num_processes=1', '--grace_s=-1', '--', 'true'], 2, '--grace_s=-1 must be >= 0.'),
        (['--num_processes=1', '--port=99999', '--', 'true'], 2, '--port=99999 must lie in '
         '1024..65534 (the start-up roll call uses the next port too); or leave it out for a free '
         'one.'),
        (['--num_processes=1'], 2, 'give the command to run after --, e.g. -- python -m '
         'engine.main --config=experiments/tiny.py --workdir=/tmp/tiny.'),
        (['--num_processes=1', '--', 'no_such_program'], 2, 'no_such_program (the command after '
         '--) is not a program on PATH; check its name, e.g. -- python -m engine.main ...'),
        (['--num_processes=1', '--', '$T/not_executable.sh'], 2, '$T/not_executable.sh (the '
         'command after --) is not an executable file; check the path, e.g. -- python -m '
         'engine.main ...'),
    ],
    'launch.slurm': [
        ([], 2, 'the following arguments are required: --nodes; python -m launch.slurm --help '
         'lists the flags.'),
        (['--nodes=0', '--dry_run', '--', 'python'], 2, '--nodes=0 must be >= 1.'),
        (['--nodes=1', '--gpus_per_node=0', '--dry_run', '--', 'python'], 2,
         '--gpus_per_node=0 must be >= 1.'),
        (['--nodes=1', '--dry_run'], 2, 'give the command to run after --, e.g. -- python -m '
         'engine.main --config=experiments/tiny.py --workdir=/tmp/tiny.'),
        (['--nodes=1', '--tasks=x', '--dry_run', '--', 'python'], 2, "argument --tasks: invalid "
         "choice: 'x' (choose from 'per_gpu', 'per_host'); python -m launch.slurm --help lists "
         'the flags.'),
        (['--nodes=1', '--time=abc', '--dry_run', '--', 'python'], 2, '--time=abc is not a SLURM '
         'time limit; write MINUTES, HH:MM:SS or DAYS-HH:MM:SS, e.g. --time=02:00:00.'),
        (['--nodes=1', '--stop_grace_s=-5', '--dry_run', '--', 'python'], 2,
         '--stop_grace_s=-5 must be >= 0.'),
        # The processes x devices, and the processes the mesh lays across hosts, checked
        # against the command's experiment before the job queues.
        (['--nodes=2', '--gpus_per_node=8', '--dry_run', '--', 'python', '-m', 'engine.main',
          '--config=experiments/tiny.py:mesh=2x2x2', '--workdir=$T/run'], 2, 'the job has 16 '
         'processes x 1 devices = 16 devices (--nodes=2 x --gpus_per_node=8, --tasks=per_gpu), '
         'but the mesh of --config=experiments/tiny.py:mesh=2x2x2 is 2x2x2x1x1x1, which needs 8; '
         'change the flags to give 8 devices, or the mesh (e.g. one axis -1).'),
        (['--nodes=2', '--gpus_per_node=8', '--dry_run', '--', 'python', '-m', 'engine.main',
          '--config=experiments/tiny.py:mesh=2x8x1', '--config.mesh.dcn_data=2',
          '--workdir=$T/run'], 2, 'the job has 16 processes (--nodes=2 x --gpus_per_node=8, '
         '--tasks=per_gpu), but mesh.dcn_data*mesh.dcn_fsdp=2 in '
         '--config=experiments/tiny.py:mesh=2x8x1 asks for 2, one per host; run one process per '
         'host (--tasks=per_host), or set mesh.dcn_data*mesh.dcn_fsdp to 16 or 1.'),
        (['--nodes=1', '--dry_run', '--', 'python', '-m', 'engine.main',
          '--config=experiments/no_such.py', '--workdir=$T/run'], 2,
         '--config=experiments/no_such.py (in the command) is not a file here; run the launcher '
         'from the directory the job runs in (the project root), or fix the path.'),
    ],
    'launch.tpu_pod': [
        ([], 2, 'the following arguments are required: --tpu, --zone; python -m launch.tpu_pod '
         '--help lists the flags.'),
        (['--tpu=my-tpu', '--dry_run', '--', 'python'], 2, 'the following arguments are '
         'required: --zone; python -m launch.tpu_pod --help lists the flags.'),
        (['--tpu=', '--zone=us-west4-a', '--dry_run', '--', 'python'], 2,
         '--tpu is empty; give one, e.g. --tpu=my-v5e-32.'),
        (['--tpu=my-tpu', '--zone=us-west4-a', '--dry_run'], 2, 'give the command to run after '
         '--, e.g. -- python -m engine.main --config=experiments/tiny.py --workdir=/tmp/tiny.'),
        (['--tpu=my-tpu', '--zone=us-west4-a', '--stop_grace_s=-1', '--dry_run', '--', 'python'],
         2, '--stop_grace_s=-1 must be >= 0.'),
        # Only the project is shipped: an experiment file outside it would be missing there.
        (['--tpu=my-tpu', '--zone=us-west4-a', '--dry_run', '--', 'python', '-m', 'engine.main',
          '--config=$T/notes.txt', '--workdir=gs://b/run'], 2, '--config=$T/notes.txt (in the '
         'command) lies outside the project, and only the project is shipped to the workers; '
         'copy it into the project, e.g. experiments/notes.txt, and give that path.'),
        (['--tpu=my-tpu', '--zone=us-west4-a', '--dry_run', '--', 'python', '-m', 'engine.main',
          '--config=experiments/no_such.py', '--workdir=gs://b/run'], 2,
         '--config=experiments/no_such.py (in the command) is not a file here; run the launcher '
         'from the project root, or fix the path.'),
    ],
}
