"""`python -m engine.sweep` end to end: a two-variant sweep of a tiny model in which one variant
fails (its workdir is a file), recorded while the sweep goes on; the rerun skips the finished
one; the table, CSV and plots (and the report on a synthetic grid of results, without
training); and --print_commands. Bad grids:
tests/support/bad_inputs_commands.py."""

import csv
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from engine.sweep import grid as sweep_grid
from engine.sweep import report as sweep_report

ROOT = pathlib.Path(__file__).resolve().parents[2]
GOOD, BAD = 'optim.learning_rate=1e-3', 'optim.learning_rate=3e-3'


def _sweep(*argv):
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='--xla_backend_optimization_level=0')
  return subprocess.run([sys.executable, '-m', 'engine.sweep', *argv], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def sweep(tmp_path_factory):
  """The sweep run twice, the second variant's workdir a file both times: (dir, runs)."""
  directory = tmp_path_factory.mktemp('sweep')
  (directory / BAD).write_text('in the way')  # engine.main refuses a workdir that is a file.
  argv = ['--config=experiments/tiny.py', '--config.model.num_layers=2',
          '--config.data.source=synthetic', '--config.train.num_steps=4',
          '--config.train.eval_every=2', '--config.train.eval_batches=1',
          '--config.train.log_every=1', '--grid=optim.learning_rate=1e-3,3e-3',
          f'--workdir={directory}']
  first = _sweep(*argv)
  good = directory / GOOD
  before = {p: p.stat().st_mtime_ns for p in good.rglob('*')}
  second = _sweep(*argv)
  after = {p: p.stat().st_mtime_ns for p in good.rglob('*')}
  return directory, first, second, before == after


@pytest.mark.slow
def test_a_failed_variant_is_recorded_and_the_sweep_goes_on(sweep):
  directory, first, _, _ = sweep
  assert first.returncode == 1, first.stderr
  assert f'[1/2] {GOOD}: started' in first.stdout
  assert f'[1/2] {GOOD}: finished in' in first.stdout
  assert f'[2/2] {BAD}: failed in' in first.stdout
  assert first.stderr.strip().splitlines()[-1] == (
      f'error: 1 of 2 variants did not finish ({BAD}); their errors are in '
      f'{directory}/sweep.json and logs/; rerun the same command to retry them.')
  state = json.loads((directory / 'sweep.json').read_text())
  assert state[GOOD]['status'] == 'finished' and state[GOOD]['exit_code'] == 0
  assert state[BAD]['status'] == 'failed' and state[BAD]['exit_code'] == 2
  assert state[BAD]['error'].startswith(f'error: --workdir={directory}/{BAD} is a file')
  assert '--config.optim.learning_rate=3e-3' in state[BAD]['command']


@pytest.mark.slow
def test_the_rerun_skips_the_finished_variant_and_retries_the_failed(sweep):
  directory, _, second, untouched = sweep
  assert second.returncode == 1, second.stderr
  assert f'[1/2] {GOOD}: finished before, skipped' in second.stdout
  assert f'[2/2] {BAD}: failed in' in second.stdout
  assert untouched  # Not one file of the finished variant was written again.
  log = (directory / 'logs' / f'{BAD}.log').read_text()
  assert log.count(f'error: --workdir={directory}/{BAD} is a file') == 2  # Ran twice.


@pytest.mark.slow
def test_the_table_csv_and_plot(sweep):
  directory, _, second, _ = sweep
  records = [json.loads(line) for line in (directory / GOOD / 'metrics.jsonl').open()]
  evals = [r['eval/loss'] for r in records if 'eval/loss' in r]
  speeds = sorted(r['train/tokens_per_s'] for r in records if 'train/tokens_per_s' in r)
  assert len(evals) == 2 and speeds  # Evals at steps 2 and 4.
  median = (speeds[(len(speeds) - 1) // 2] + speeds[len(speeds) // 2]) / 2
  summary = json.loads((directory / GOOD / 'summary.json').read_text())
  assert summary['mfu'] is None  # CPUs have no known peak.
  peak_mib = summary['peak_memory_bytes'] / 2**20
  trains = [r['train/loss'] for r in records if 'train/loss' in r]
  table = (directory / 'sweep.md').read_text()
  assert table in second.stdout
  assert table.splitlines()[0] == ('| variant | status | final train loss | final eval loss | '
                                   'best eval loss | tokens/s | MFU | peak memory MiB |')
  # The only finished variant is the best.
  assert table.splitlines()[2] == (f'| {GOOD} (best) | finished | {trains[-1]:.4f} | '
                                   f'{evals[-1]:.4f} | {min(evals):.4f} | {median:,.0f} | - | '
                                   f'{peak_mib:.1f} |')
  assert table.splitlines()[3] == f'| {BAD} | failed | - | - | - | - | - | - |'
  assert table.splitlines()[5] == (f'Best: {GOOD}, the lowest final eval loss ({evals[-1]:.4f}) '
                                   'of 1 finished variant.')
  rows = list(csv.DictReader((directory / 'sweep.csv').open()))
  assert [r['variant'] for r in rows] == [GOOD, BAD]
  assert float(rows[0]['final_train_loss']) == pytest.approx(trains[-1])
  assert float(rows[0]['final_eval_loss']) == pytest.approx(evals[-1])
  assert float(rows[0]['best_eval_loss']) == pytest.approx(min(evals))
  assert (rows[0]['best'], rows[1]['best']) == ('1', '0')
  assert rows[1]['status'] == 'failed' and rows[1]['final_eval_loss'] == ''
  for plot in ('loss_curves.png', 'final_loss.png'):
    assert (directory / plot).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_print_commands_prints_every_variant_and_runs_nothing(tmp_path):
  directory = tmp_path / 'sweep'
  result = _sweep('--config=experiments/tiny.py:steps=10', '--config.train.log_every=5',
                  '--grid=mode=auto,manual', '--grid=mesh=8x1x1,2x2x2', f'--workdir={directory}',
                  '--print_commands')
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == 4 and not directory.exists()
  assert lines[0] == (
      f'{sys.executable} -m engine.main --config=experiments/tiny.py:steps=10 '
      '--config.train.log_every=5 --config.parallelism.mode=auto --config.mesh.data=8 '
      '--config.mesh.fsdp=1 --config.mesh.tensor=1 --config.mesh.context=1 --config.mesh.stage=1 '
      f'--config.mesh.expert=1 --workdir={directory}/mode=auto,mesh=8x1x1')
  assert lines[3].endswith('--config.parallelism.mode=manual --config.mesh.data=2 '
                           '--config.mesh.fsdp=2 --config.mesh.tensor=2 --config.mesh.context=1 '
                           '--config.mesh.stage=1 --config.mesh.expert=1 '
                           f'--workdir={directory}/mode=manual,mesh=2x2x2')


def test_a_finished_variant_runs_again_when_its_command_changed():
  command = ['python', '-m', 'engine.main', '--config=experiments/tiny.py:steps=4']
  record = {'status': 'finished', 'command': shlex.join(command)}
  assert sweep_grid.already_finished(record, command)
  assert not sweep_grid.already_finished(record, command[:-1] + ['--config=tiny.py:steps=8'])
  assert not sweep_grid.already_finished({**record, 'status': 'failed'}, command)
  assert not sweep_grid.already_finished({}, command)


def _synthetic_sweep(directory):
  """A 2 x 2 grid's workdirs with made-up metrics.jsonl (no training): learning rate x layers,
  the final eval loss lowest at 3e-3 with 4 layers; one variant failed before any eval."""
  grid = sweep_grid.parse_grid(['optim.learning_rate=1e-3,3e-3', 'model.num_layers=2,4'])
  variants = sweep_grid.variants(grid)
  losses = {  # name: (final train loss, final eval loss)
      variants[0].name: (2.0, 2.2), variants[1].name: (1.8, 2.1),
      variants[2].name: (1.5, 1.9), variants[3].name: (1.9, None)}
  rows, workdirs = {}, {}
  for variant in variants:
    train, final_eval = losses[variant.name]
    workdir = directory / variant.name
    workdir.mkdir()
    records = [{'step': 1, 'train/loss': train + 1}, {'step': 2, 'train/loss': train}]
    if final_eval is not None:
      records += [{'step': 1, 'eval/loss': final_eval - 0.05},  # Best eval at step 1.
                  {'step': 2, 'eval/loss': final_eval}]
    (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    status = 'failed' if final_eval is None else 'finished'
    workdirs[variant.name] = str(workdir)
    rows[variant.name] = sweep_report.results(str(workdir), status)
  return variants, rows, workdirs


def test_the_report_marks_the_best_variant_and_plots_the_final_losses(tmp_path):
  variants, rows, workdirs = _synthetic_sweep(tmp_path)
  names = [v.name for v in variants]
  values = {v.name: v.values for v in variants}
  table = sweep_report.write_all(str(tmp_path), rows, workdirs, values).splitlines()
  assert table[0].startswith('| variant | status | final train loss | final eval loss | best '
                             'eval loss |')
  assert table[2].startswith(f'| {names[0]} | finished | 2.0000 | 2.2000 | 2.1500 |')
  assert table[4].startswith(f'| {names[2]} (best) | finished | 1.5000 | 1.9000 | 1.8500 |')
  assert table[5].startswith(f'| {names[3]} | failed | 1.9000 | - | - |')
  assert sum('(best)' in line for line in table) == 1
  assert table[-1] == (f'Best: {names[2]}, the lowest final eval loss (1.9000) of 3 finished '
                       'variants.')
  rows_csv = list(csv.DictReader((tmp_path / 'sweep.csv').open()))
  assert [r['best'] for r in rows_csv] == ['0', '0', '1', '0']
  assert float(rows_csv[1]['final_train_loss']) == 1.8
  # Against each swept value: one line per value of the other key; the failed variant's missing
  # eval loss is left out of its line, its train loss kept.
  series = sweep_report.final_loss_series(rows, values)
  assert list(series) == ['optim.learning_rate', 'model.num_layers']
  assert series['optim.learning_rate'] == {
      'model.num_layers=2': {'eval': [('1e-3', 2.2), ('3e-3', 1.9)],
                             'train': [('1e-3', 2.0), ('3e-3', 1.5)]},
      'model.num_layers=4': {'eval': [('1e-3', 2.1)], 'train': [('1e-3', 1.8), ('3e-3', 1.9)]}}
  assert series['model.num_layers']['optim.learning_rate=3e-3'] == {
      'eval': [('2', 1.9)], 'train': [('2', 1.5), ('4', 1.9)]}
  png = (tmp_path / 'final_loss.png').read_bytes()
  assert png[:8] == b'\x89PNG\r\n\x1a\n'
  width = int.from_bytes(png[16:20], 'big')
  assert width == 1000  # Two panels of 5 inches at 100 dpi: one per swept key.


def test_the_best_variant_falls_back_to_train_loss_and_needs_a_finished_one():
  row = lambda status, train, final_eval: {'status': status, 'final_train_loss': train,
                                            'final_eval_loss': final_eval}
  no_evals = {'a': row('finished', 2.0, None), 'b': row('finished', 1.0, None)}
  assert sweep_report.ranking_key(no_evals) == 'final_train_loss'
  assert sweep_report.best_variant(no_evals) == 'b'
  # A failed variant's lower loss (an early stop) never wins.
  assert sweep_report.best_variant({'a': row('finished', 2.0, 2.5),
                                    'b': row('failed', 1.0, 1.5)}) == 'a'
  assert sweep_report.best_variant({'a': row('failed', 1.0, 1.5)}) is None
