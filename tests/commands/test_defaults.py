"""What a user sees on the happy path, as the real command lines (forked from one process that
imported JAX and the engine once: tests/support/forked_commands.py), on conftest.py's finished
run: generate, evaluate and export with their defaults print no library warning; generate samples
by default (a seed changes the sample), is greedy at --temperature=0 and takes a --top_k past the
vocabulary as every token; a rerun of the finished run writes nothing, exits 0 and says how to
train further, and that advice works; --help exits 0 with the command's usage."""

import os
import re
import shutil

import pytest

from engine.cli.usage import COMMANDS
from tests.commands.conftest import FINISHED_RUN_ARGV
from tests.support.bad_input_checks import ROOT
from tests.support.processes import forked

PROMPT = '--prompt=def '


def _warnings(output: str) -> list[str]:
  """Warning and error records in `output`: absl's (`W1205 09:10:56.1 ...`), Python logging's
  (`WARNING:absl:...`) and Python's warnings (`...Warning: ...`)."""
  return [line for line in output.splitlines()
          if re.match(r'[WE](\d{4}| \d\d:)', line) or re.match(r'(WARNING|ERROR)[: ]', line)
          or re.search(r'\w+Warning: ', line)]


def _files(directory) -> dict[str, tuple[int, bytes]]:
  """Every file under `directory`: (modification time, bytes)."""
  found = {}
  for parent, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(parent, name)
      with open(path, 'rb') as f:
        found[os.path.relpath(path, directory)] = (os.stat(path).st_mtime_ns, f.read())
  return found


@pytest.fixture(scope='module')
def outputs(finished_run, tmp_path_factory):
  """The rows below, run once: {name: result}; and the finished run's files before and after."""
  scratch = tmp_path_factory.mktemp('defaults')
  extended = scratch / 'extended'
  shutil.copytree(finished_run, extended)
  run = f'--workdir={finished_run}'
  rows = {
      'generate': ('engine.generate', [run, PROMPT]),
      'generate seed 1': ('engine.generate', [run, PROMPT, '--seed=1']),
      'greedy': ('engine.generate', [run, PROMPT, '--temperature=0']),
      'greedy seed 1': ('engine.generate', [run, PROMPT, '--temperature=0', '--seed=1']),
      'every token': ('engine.generate', [run, PROMPT, '--top_k=0']),
      'top_k past the vocabulary': ('engine.generate', [run, PROMPT, '--top_k=100000']),
      'evaluate': ('engine.evaluate', [run]),
      'export': ('engine.export', [run, f'--out={scratch}/hf']),
      'rerun': ('engine.main', [*FINISHED_RUN_ARGV, run]),
  }
  before = _files(finished_run)
  results = forked([{'program': program, 'argv': argv, 'cwd': ROOT}
                    for program, argv in rows.values()])
  found = dict(zip(rows, results))
  # The advice of the rerun's last line, followed on a copy of the run.
  advice = re.search(r'rerun with --config\.train\.num_steps=M \(M > 2\) and '
                     r'(--config\.optim\.decay_steps=\d+)', found['rerun']['output'])
  assert advice, found['rerun']['output']
  found['extended'] = forked([{
      'program': 'engine.main', 'cwd': ROOT,
      'argv': [*FINISHED_RUN_ARGV, '--config.train.num_steps=3', advice.group(1),
               f'--workdir={extended}']}])[0]
  return found, before, _files(finished_run), extended


def _sample(result: dict) -> str:
  assert result['code'] == 0, result['output'][-3000:]
  text = result['output']
  return text[text.index("--- 'def '"):]


@pytest.mark.slow
def test_default_commands_print_no_library_warnings(outputs):
  found = outputs[0]
  for name in ('generate', 'evaluate', 'export', 'rerun'):
    assert found[name]['code'] == 0, (name, found[name]['output'][-3000:])
    assert not _warnings(found[name]['output']), (name, found[name]['output'])


@pytest.mark.slow
def test_generate_samples_by_default_and_is_greedy_at_temperature_zero(outputs):
  found = outputs[0]
  samples = {name: _sample(found[name])
             for name in ('generate', 'generate seed 1', 'greedy', 'greedy seed 1')}
  assert samples['greedy'] == samples['greedy seed 1']  # Greedy ignores the seed,
  assert samples['generate'] != samples['generate seed 1']  # the default draws do not,
  assert samples['generate'] != samples['greedy']  # and differ from greedy.


@pytest.mark.slow
def test_a_top_k_past_the_vocabulary_restricts_nothing(outputs):
  found = outputs[0]
  assert _sample(found['top_k past the vocabulary']) == _sample(found['every token'])


@pytest.mark.slow
def test_a_rerun_of_a_finished_run_writes_nothing_and_says_how_to_go_on(outputs):
  found, before, after, extended = outputs
  assert found['rerun']['code'] == 0
  assert after == before  # config.json, summary.json, loss_curve.png: not even rewritten.
  assert ('is finished: its checkpoint is at step 2 (train.num_steps=2), so nothing was trained '
          'or written') in found['rerun']['output']
  # The advice works: the copy trains one more step from its checkpoint.
  assert found['extended']['code'] == 0, found['extended']['output'][-3000:]
  assert sorted(os.listdir(extended / 'checkpoints')) == ['2', '3']


def test_help_exits_0_with_the_usage_first():
  rows = [{'program': program, 'argv': [flag], 'cwd': ROOT}
          for program in COMMANDS for flag in ('--help', '--helpfull')]
  for row, result in zip(rows, forked(rows)):
    lines = result['output'].splitlines()
    usage, about, _ = COMMANDS[row['program']]
    assert result['code'] == 0, (row, result['output'][-2000:])
    assert lines[0] == f'usage: {usage}', (row, lines[:3])
    paragraph = lines[2:lines.index('', 2)]
    assert ' '.join(paragraph) == about, (row, lines[:5])  # What it does, for its user.
    assert 'Traceback' not in result['output']
    assert re.search(r'^\s+--\w+', result['output'], re.M), 'no flag is listed'


def test_every_command_has_its_usage():
  programs = set()
  for directory, _, names in os.walk(os.path.join(ROOT, 'engine')):
    for name in names:
      if name.endswith('.py'):
        with open(os.path.join(directory, name)) as f:
          programs |= set(re.findall(r"run_command\(main, '([\w.]+)'", f.read()))
  assert programs | {'engine.main'} == set(COMMANDS)


def test_an_old_output_flag_name_still_works(tmp_path):
  """engine.analysis.compare's report directory is --out, as every other command's output;
  --workdir, its earlier name, sets the same flag."""
  (tmp_path / 'notes.txt').write_text('')
  config = '--config=experiments/tiny.py'
  rows = [{'program': 'engine.analysis.compare', 'argv': [config, *argv], 'cwd': ROOT}
          for argv in ([f'--workdir={tmp_path}/notes.txt'], [f'--out={tmp_path}/notes.txt'], [])]
  old, new, none = (result['output'].strip().splitlines()[-1] for result in forked(rows))
  assert old == new == (f'error: --out={tmp_path}/notes.txt is a file, not a directory; pass a '
                        'new path or a directory to write into.')
  assert none == 'error: --out is required: Directory for report.md, report.json and the plots.'
