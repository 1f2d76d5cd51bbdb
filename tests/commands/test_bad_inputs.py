"""Bad input to `python -m engine.main`: each row of BAD_INPUTS (tests/support/bad_inputs_main.py)
is something a user could type, with the exit status and the one line, `error: ...`, that it
gets: no traceback, nothing written, nothing compiled. docs/bad_inputs.md lists the same rows, and
the other commands' (tests/commands/test_command_bad_inputs.py), in tables
tests/support/bad_input_checks.py prints.

The rows run inside this process (engine.main.run parses the flags afresh each time), on the 8
simulated CPU devices of conftest.py, and no XLA compile may happen before the error; two of them
also run as the real command. In argv and messages, `$T` stands for the test's scratch
directory, which holds the files of SCRATCH.
"""

import os
import subprocess
import sys

import jax
import pytest

from engine import main as engine_main
from engine.errors import ConfigError
from engine.workdir import run_dir
from tests.support.bad_input_checks import (ROOT, all_rows, bad_inputs_tables,
                                            check_nothing_written, check_output, doc_rows,
                                            make_scratch, snapshot, substitute)
from tests.support.bad_inputs_main import BAD_INPUTS, SCRATCH, TINY

# ml_collections loads experiment files with a loader method Python deprecates (silent on the CLI).
pytestmark = pytest.mark.filterwarnings('ignore:the load_module.. method is deprecated')

COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # One per XLA compile.


@pytest.fixture
def compiles():
  """The XLA compiles that happen while the test runs."""
  seen = []

  def listener(event: str, seconds: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
      seen.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(listener)
  yield seen
  jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize('row', BAD_INPUTS, ids=[' '.join(row[0]) for row in BAD_INPUTS])
def test_bad_input_gets_one_line(row, tmp_path, capfd, monkeypatch, compiles):
  monkeypatch.chdir(ROOT)  # Experiment paths are relative to the repository, as in the README.
  argv, expected_code, expected_line = row
  make_scratch(tmp_path, SCRATCH)
  before = snapshot(tmp_path)
  code = engine_main.run([substitute(arg, T=tmp_path) for arg in argv])
  out, err = capfd.readouterr()
  check_output(out + err, code, expected_code, substitute(expected_line, T=tmp_path))
  check_nothing_written(before, snapshot(tmp_path))
  assert not compiles, f'{len(compiles)} XLA compiles before the error'


def test_the_compile_listener_sees_compiles(compiles):
  jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7))  # A program no other test compiles.
  assert compiles


# Through the real command (absl's app.run): a flag absl rejects, and a value the config refuses.
CLI_ROWS = [row for row in BAD_INPUTS if row[0][-1] in ('--config.train.num_steps=abc',
                                                        '--config.optim.b2=1.5')]


@pytest.mark.parametrize('row', CLI_ROWS, ids=[row[0][-1] for row in CLI_ROWS])
def test_the_command_line_gets_the_same_line(row, tmp_path):
  argv, expected_code, expected_line = row
  make_scratch(tmp_path, SCRATCH)
  before = snapshot(tmp_path)
  env = dict(os.environ, JAX_PLATFORMS='cpu')  # conftest's XLA_FLAGS: 8 devices, as above.
  proc = subprocess.run(
      [sys.executable, '-m', 'engine.main', *[substitute(a, T=tmp_path) for a in argv]],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  check_output(proc.stdout + proc.stderr, proc.returncode, expected_code,
               substitute(expected_line, T=tmp_path))
  check_nothing_written(before, snapshot(tmp_path))


def test_a_gs_workdir_without_the_gcs_extra_says_what_to_install(capfd, monkeypatch, compiles):
  """gcsfs hidden, as without the gcs extra (etils.epath raises ImportError at the first access):
  not a table row, which a machine with the extra would send to a bucket."""
  monkeypatch.chdir(ROOT)
  monkeypatch.setitem(sys.modules, 'gcsfs', None)
  monkeypatch.setattr(run_dir, '_USABLE_SCHEMES', set())  # No earlier test's access counts.
  code = engine_main.run([TINY, '--workdir=gs://bucket/run'])
  out, err = capfd.readouterr()
  check_output(out + err, code, 2, '--workdir=gs://bucket/run: gs:// paths need gcsfs and '
               'google-cloud-storage (the gcs extra), which are not installed; install them with '
               'pip install -e ".[gcs]", or pass a local path.')
  assert not compiles


def test_debug_shows_the_traceback_instead(tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)
  with pytest.raises(ConfigError, match='optim.b2=1.5'):
    engine_main.run([TINY, f'--workdir={tmp_path}/run', '--config.optim.b2=1.5', '--debug'])
  with pytest.raises(Exception, match='num_steps'):
    engine_main.run([TINY, f'--workdir={tmp_path}/run', '--config.train.num_steps=abc', '--debug'])


def test_rows_are_distinct():
  for program, rows in all_rows().items():
    argvs = [tuple(row[0]) for row in rows]
    assert len(set(argvs)) == len(argvs), program
    assert not any(' ' in arg for argv in argvs for arg in argv)  # The table joins them by spaces.
  assert len(BAD_INPUTS) >= 88
  assert sum(len(rows) for rows in all_rows().values()) >= 120


def test_the_docs_tables_list_every_row():
  expected = {program: [(list(argv), code, message) for argv, code, message in rows]
              for program, rows in all_rows().items()}
  assert doc_rows() == expected, (
      'docs/bad_inputs.md\'s tables differ from the rows; the tables that match (python -m '
      'tests.support.bad_input_checks prints them):\n' + bad_inputs_tables())
