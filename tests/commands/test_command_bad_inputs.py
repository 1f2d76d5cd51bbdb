"""Bad input to every command but engine.main: each row of COMMAND_ROWS
(tests/support/bad_inputs_commands.py) runs as the real command line (`python -m PROGRAM ARGV`,
forked from one process that imported JAX and the engine once: tests/support/forked_commands.py)
and must get its one line, `error: ...`, and exit status: no traceback, nothing written (in its
scratch directory, nor in the finished run it reads, tests/commands/conftest.py's), no XLA compile.
"""

import pytest

from tests.support.bad_input_checks import (ROOT, check_nothing_written, check_output,
                                            make_scratch, snapshot, substitute)
from tests.support.bad_inputs_commands import COMMAND_ROWS, COMMAND_SCRATCH
from tests.support.processes import forked

ROWS = [(program, *row) for program, rows in COMMAND_ROWS.items() for row in rows]


@pytest.fixture(scope='module')
def results(finished_run, tmp_path_factory):
  """Every row run once, each with a scratch directory of its own: {row index: (scratch,
  result, the scratch before)}."""
  run_before = snapshot(finished_run)
  scratches, commands = [], []
  for index, (program, argv, _, _) in enumerate(ROWS):
    scratch = tmp_path_factory.mktemp(f'row{index}')
    make_scratch(scratch, COMMAND_SCRATCH)
    scratches.append((scratch, snapshot(scratch)))
    commands.append({'program': program, 'cwd': ROOT,
                     'argv': [substitute(a, T=scratch, RUN=finished_run) for a in argv]})
  results = forked(commands)
  assert snapshot(finished_run) == run_before  # No row changed the run it read.
  return [(scratch, result, before) for (scratch, before), result in zip(scratches, results)]


@pytest.mark.slow
@pytest.mark.parametrize('index', range(len(ROWS)),
                         ids=[f'{p} {" ".join(argv)}' for p, argv, _, _ in ROWS])
def test_bad_input_gets_one_line(index, results, finished_run):
  _, _, expected_code, expected_line = ROWS[index]
  scratch, result, before = results[index]
  check_output(result['output'], result['code'], expected_code,
               substitute(expected_line, T=scratch, RUN=finished_run))
  check_nothing_written(before, snapshot(scratch))
  assert result['compiles'] == 0, f'{result["compiles"]} XLA compiles before the error'


def test_every_command_has_rows():
  commands = {'engine.generate', 'engine.evaluate', 'engine.export', 'engine.bench',
              'engine.lm_eval',
              'engine.bench.host_link', 'engine.bench.loop_cost',
              'engine.plan', 'engine.analysis.bubble', 'engine.analysis.compare',
              'engine.analysis.show_layout', 'engine.analysis.hf_check',
              'engine.analysis.tokenizer_check', 'launch.local',
              'launch.slurm', 'launch.tpu_pod', 'engine.data.prepare',
              'engine.data.train_tokenizer', 'engine.sweep'}
  assert commands <= set(COMMAND_ROWS)
