"""Every command example of README.md, docs/*.md and the experiments' docstrings is checked:
tests/support/doc_commands.py's CHECKS says for each how (run reduced, or skipped with a reason),
and each run command runs as the real command line (forked from one process that imported JAX
and the engine once: tests/support/forked_commands.py), must exit 0 and write what the docs say
it writes.
"""

import os

import pytest

from tests.support import doc_commands
from tests.support.doc_commands import CHECKS, ROOT, Run
from tests.support.processes import forked

EXAMPLES = doc_commands.extract()
RUNS = sorted(((k, c) for k, c in CHECKS.items() if isinstance(c, Run)),
              key=lambda kc: (kc[1].chain, kc[1].order))


def test_every_example_has_a_check():
  missing = {doc_commands.key(words): source for source, words in EXAMPLES
             if doc_commands.key(words) not in CHECKS}
  assert not missing, (
      'command examples without an entry in CHECKS (tests/support/doc_commands.py); add, and fill '
      'in:\n'
      + ''.join(f"    # {source}\n    {key!r}:\n        Run('CHAIN', add=(...)) or Skip('why'),\n"
                for key, source in missing.items()))


def test_no_stale_checks():
  stale = set(CHECKS) - {doc_commands.key(words) for _, words in EXAMPLES}
  assert not stale, f'CHECKS entries no document holds any more; remove: {sorted(stale)}'


def test_extraction_joins_continued_lines_and_splits_setup():
  keys = {doc_commands.key(words) for _, words in EXAMPLES}
  # README's first line: the setup commands and the run, one entry each.
  assert {'python3.11 -m venv .venv', 'pip install -e .[test]',
          'python -m engine.main --config=experiments/tiny.py --workdir=/tmp/engine_tiny'} <= keys
  assert not [k for k in keys if '\\' in k or '#' in k or '&&' in k]


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  """Every Run entry, in its chain's order, each chain in a scratch directory of its own:
  {key: (scratch, result)}."""
  scratches, commands = {}, []
  for key, check in RUNS:
    if check.chain not in scratches:
      scratches[check.chain] = str(tmp_path_factory.mktemp(check.chain))
    scratch = scratches[check.chain]
    for name, text in check.files:
      with open(os.path.join(scratch, name), 'w') as f:
        f.write(text)
    env, argv = doc_commands.reduced(key.split(' '), check, scratch)
    commands.append({'program': argv[0], 'argv': argv[1:], 'cwd': str(ROOT), 'env': env})
  return {key: (scratches[check.chain], result)
          for (key, check), result in zip(RUNS, forked(commands))}


@pytest.mark.slow
@pytest.mark.parametrize('key', [k for k, _ in RUNS],
                         ids=[f'{c.chain}:{k.split("python -m ", 1)[1].split(" ")[0]}'
                              for k, c in RUNS])
def test_example_runs(key, results):
  scratch, result = results[key]
  assert result['code'] == 0, f'{key}\nexited {result["code"]}:\n{result["output"][-3000:]}'
  for output in CHECKS[key].outputs:
    path = doc_commands.move_tmp(output, scratch)
    assert os.path.exists(path), f'{key}\nwrote no {path}:\n{result["output"][-3000:]}'
