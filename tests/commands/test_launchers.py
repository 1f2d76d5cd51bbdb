"""The launchers' dry runs print exactly what they would run; the local launcher's plumbing."""

import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from launch import local, slurm, tpu_pod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _output(main, argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = main(argv)
  return code, out.getvalue()


COMMAND = ['python', '-m', 'engine.main', '--config=experiments/shakespeare_char.py:mesh=-1x1x1',
           '--workdir=gs://bucket/run']


def test_tpu_pod_dry_run_prints_sync_then_run_on_all_workers():
  code, out = _output(tpu_pod.main, ['--tpu=pod-1', '--zone=us-west4-a', '--project=proj',
                                     '--dry_run', '--', *COMMAND])
  assert code == 0
  lines = out.strip().splitlines()
  assert len(lines) == 4
  assert lines[0] == "bash -c 'git ls-files -z | xargs -0 tar czf /tmp/engine_code.tgz'"
  assert shlex.split(lines[1]) == [
      'gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', '/tmp/engine_code.tgz',
      'pod-1:~/engine_code.tgz', '--zone', 'us-west4-a', '--worker=all', '--project', 'proj']
  ssh = shlex.split(lines[2])
  assert ssh[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', 'pod-1']
  assert '--worker=all' in ssh and ssh[-2] == '--command'
  remote = ssh[-1]
  assert remote.startswith('mkdir -p ~/engine && tar xzf ~/engine_code.tgz -C ~/engine && '
                           'cd ~/engine && python3 -m pip install')
  assert remote.endswith(shlex.join(COMMAND))
  stop = shlex.split(lines[3].removeprefix('# on SIGTERM / Ctrl-C: '))
  assert stop[:6] == ssh[:6] and '--worker=all' in stop
  assert stop[-1].startswith('pkill -TERM -f -- ')


def test_slurm_dry_run_prints_the_batch_script_and_sbatch(tmp_path):
  script = tmp_path / 'job.sbatch'
  code, out = _output(slurm.main, ['--nodes=4', '--gpus_per_node=8', '--partition=gpu',
                                   '--time=02:00:00', f'--script={script}', '--dry_run', '--',
                                   *COMMAND])
  assert code == 0
  assert not script.exists()  # A dry run writes nothing.
  for line in ['#SBATCH --nodes=4', '#SBATCH --ntasks-per-node=8', '#SBATCH --gpus-per-node=8',
               '#SBATCH --gpus-per-task=1', '#SBATCH --time=02:00:00',
               '#SBATCH --partition=gpu', '#SBATCH --signal=TERM@120',
               'srun --kill-on-bad-exit=1 ' + shlex.join(COMMAND),
               f'sbatch {script}']:
    assert line in out.splitlines(), line


def test_slurm_requeue_and_stop_grace():
  _, out = _output(slurm.main, ['--nodes=2', '--requeue', '--stop_grace_s=300', '--dry_run', '--',
                                *COMMAND])
  lines = out.splitlines()
  assert '#SBATCH --signal=TERM@300' in lines and '#SBATCH --requeue' in lines


def test_tpu_pod_forwards_sigterm_to_every_worker(tmp_path):
  # A fake gcloud: records its arguments; the remote command 'runs' until the launcher gives up.
  log = tmp_path / 'calls'
  fake = tmp_path / 'bin' / 'gcloud'
  fake.parent.mkdir()
  fake.write_text(f'#!/bin/bash\necho "$*" >> {log}\n'
                  'case "$*" in *pkill*) exit 0;; *--command*) exec sleep 60;; esac\n')
  fake.chmod(0o755)
  env = dict(os.environ, PATH=f'{fake.parent}:{os.environ["PATH"]}')
  launcher = subprocess.Popen(
      [sys.executable, '-m', 'launch.tpu_pod', '--tpu=pod-1', '--zone=z', '--stop_grace_s=1',
       '--', *COMMAND], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)
  deadline = time.monotonic() + 60
  while not (log.exists() and '--command mkdir' in log.read_text()):
    assert time.monotonic() < deadline and launcher.poll() is None
    time.sleep(0.1)
  launcher.send_signal(signal.SIGTERM)
  output, _ = launcher.communicate(timeout=60)
  assert 'asking every worker to checkpoint and stop' in output
  stops = [line for line in log.read_text().splitlines() if 'pkill -TERM' in line]
  assert len(stops) == 1 and '--worker=all' in stops[0] and 'engine\\.main' in stops[0]


def test_slurm_one_task_per_host():
  _, out = _output(slurm.main, ['--nodes=2', '--tasks=per_host', '--dry_run', '--', *COMMAND])
  assert '#SBATCH --ntasks-per-node=1' in out and '--gpus-per-task' not in out


def test_local_launcher_environment_per_process():
  env = local.process_env({'XLA_FLAGS': '--xla_force_host_platform_device_count=8 --foo'}, 1, 4,
                          2, 1234)
  assert env['JAX_COORDINATOR_ADDRESS'] == '127.0.0.1:1234'
  assert (env['JAX_NUM_PROCESSES'], env['JAX_PROCESS_ID']) == ('4', '1')
  assert env['XLA_FLAGS'] == '--foo --xla_force_host_platform_device_count=2'


def test_local_launcher_propagates_a_failure():
  code = local.launch(['python', '-c', 'import os, sys, time; '
                       'sys.exit(3) if os.environ["JAX_PROCESS_ID"] == "1" else time.sleep(60)'],
                      num_processes=2, devices_per_process=1, grace_s=1)
  assert code == 3


def test_local_launcher_drops_only_gloos_connection_notices():
  notice = ('[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer '
            'ranks is : 1')
  lines = [notice.format(0) + '\n',
           notice.format(1) + notice.format(0) + '\n',  # Two threads' messages on one line...
           'I1201 train.py:169] Mesh {...}\n',
           '\n',  # ...and the second one's newline, later.
           '\n',  # A real empty line: kept.
           'warning: [Gloo] Rank 0 is connected to 1 peer ranks.\n',  # Not only the notice.
           notice.format(2) + ' and more\n',
           'Traceback (most recent call last):\n']
  shown = local.GlooFilter()
  kept = [line for line in lines if shown.keep(line)]
  assert kept == lines[2:3] + lines[4:]


def _git_project(tmp_path):
  """A project with one tracked file and an untracked experiment, as a user's checkout."""
  for command in (['git', 'init', '-q'], ['git', 'config', 'user.email', 'a@b'],
                  ['git', 'config', 'user.name', 'a']):
    subprocess.run(command, cwd=tmp_path, check=True)
  (tmp_path / 'experiments').mkdir()
  (tmp_path / 'tracked.py').write_text('x = 1\n')
  subprocess.run(['git', 'add', 'tracked.py'], cwd=tmp_path, check=True)
  (tmp_path / 'experiments' / 'mine.py').write_text('def get_config(arg=None): ...\n')
  (tmp_path / 'scratch.txt').write_text('not shipped\n')


def test_tpu_pod_ships_an_untracked_experiment_and_installs_what_the_run_needs(tmp_path,
                                                                               monkeypatch):
  _git_project(tmp_path)
  monkeypatch.chdir(tmp_path)
  command = ['python', '-m', 'engine.main', '--config=experiments/mine.py:steps=5',
             '--config.data.path=gs://b/data.txt', '--workdir=/tmp/run']
  extra = tpu_pod.experiment_file(command)
  assert extra == 'experiments/mine.py'
  assert tpu_pod.experiment_file(['python', '-m', 'engine.main', '--config=tracked.py']) is None
  pack, _, ssh = tpu_pod.plan('pod', 'z', None, '~/e', 'pip install wandb', command, extra)
  # The packing step, run for real into a scratch archive: tracked files and the experiment.
  archive = tmp_path / 'code.tgz'
  subprocess.run(['bash', '-c', pack[2].replace(tpu_pod.ARCHIVE, str(archive))], check=True)
  listed = subprocess.run(['tar', 'tzf', str(archive)], capture_output=True, text=True,
                          check=True).stdout.split()
  assert sorted(listed) == ['experiments/mine.py', 'tracked.py']
  # A gs:// path (here the data) brings the gcs extra; --setup runs after the install.
  assert ('cd ~/e && python3 -m pip install -q -e ".[tpu,gcs]" && pip install wandb && '
          + shlex.join(command)) in ssh[-1]
  _, _, local_run = tpu_pod.plan('pod', 'z', None, '~/e', '', ['python', 'x.py'])
  assert local_run[-1].endswith('python3 -m pip install -q -e ".[tpu]" && python x.py')


def test_the_readme_slurm_example_fits_its_mesh():
  text = open(os.path.join(ROOT, 'README.md')).read()
  start = text.index('python -m launch.slurm')
  example = text[start:text.index('```', start)].replace('\\\n', ' ').split('\n')[0]
  argv = shlex.split(example)[3:]  # After `python -m launch.slurm`.
  dashes = argv.index('--')
  code, out = _output(slurm.main, argv[:dashes] + ['--dry_run'] + argv[dashes:])
  assert code == 0 and '--config.mesh.dcn_data=2' in out


def test_the_mesh_check_fills_the_minus_one_as_the_engine_does(monkeypatch, capsys):
  monkeypatch.chdir(ROOT)
  engine_main = ['--', 'python', '-m', 'engine.main', '--workdir=/tmp/run']
  # 2 nodes x 8 GPUs: 16 devices, which -1x1x2 fills (-1 is 8) and 3x1x1 cannot.
  code, _ = _output(slurm.main, ['--nodes=2', '--dry_run', *engine_main,
                                 '--config=experiments/tiny.py:mesh=-1x1x2'])
  assert code == 0
  for mesh, said in (('3x1x1', 'is 3x1x1x1x1x1, which needs 3;'),
                     ('-1x3x2', 'is -1x3x2x1x1x1, which needs a multiple of 6;'),
                     ('-1x-1x2', 'mesh: only one axis may be -1')):
    with pytest.raises(SystemExit) as exit_:
      slurm.main(['--nodes=2', '--dry_run', *engine_main,
                  f'--config=experiments/tiny.py:mesh={mesh}'])
    assert exit_.value.code == 2 and said in capsys.readouterr().err, mesh
  # An override read as the engine reads it: one dash, and the value as the next argument.
  with pytest.raises(SystemExit):
    slurm.main(['--nodes=2', '--dry_run', *engine_main, '--config=experiments/tiny.py',
                '-config.mesh.data', '0'])
  assert 'mesh.data=0: axis sizes must be positive' in capsys.readouterr().err


def test_the_launchers_start_no_jax():
  """A launcher runs on a login node or a laptop: it reads the engine's mesh rules (engine.config,
  engine.cli.argv), never JAX."""
  code = 'import sys, launch.local, launch.slurm, launch.tpu_pod; print("jax" in sys.modules)'
  done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0 and done.stdout.strip() == 'False', done.stderr[-2000:]
