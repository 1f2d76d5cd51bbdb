"""What the bad-input tests share: each row's scratch directory, the check of its one `error:`
line, the check that nothing was written, and docs/bad_inputs.md's tables (one per command),
printed by `python -m tests.support.bad_input_checks` after a row changes."""

import os
import re

from tests.support.bad_inputs_commands import COMMAND_ROWS
from tests.support.bad_inputs_main import BAD_INPUTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAD_INPUTS_DOC = os.path.join(ROOT, 'docs', 'bad_inputs.md')


def make_scratch(directory, files: dict) -> None:
  """Writes `files` (name: text, bytes, or None for a directory) under `directory`."""
  for name, content in files.items():
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
      path.mkdir(exist_ok=True)
    elif isinstance(content, bytes):
      path.write_bytes(content)
    else:
      path.write_text(content)


def snapshot(directory) -> dict[str, bytes | None]:
  """Every path under `directory`: a file's bytes, None for a directory."""
  found = {}
  for parent, dirs, files in os.walk(directory):
    for name in dirs:
      found[os.path.relpath(os.path.join(parent, name), directory)] = None
    for name in files:
      with open(os.path.join(parent, name), 'rb') as f:
        found[os.path.relpath(os.path.join(parent, name), directory)] = f.read()
  return found


def substitute(text: str, **places) -> str:
  """`text` with $NAME replaced by places[NAME] (longest names first)."""
  for name in sorted(places, key=len, reverse=True):
    text = text.replace(f'${name}', str(places[name]))
  return text


def check_output(output: str, code: int, expected_code: int, expected_line: str) -> None:
  """One `error:` line, exactly the expected one; no traceback; the expected exit status."""
  assert 'Traceback' not in output, output
  errors = [line for line in output.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1, output  # One line says it all.
  assert errors[0] == 'error: ' + expected_line
  assert code == expected_code, (code, output)


def check_nothing_written(before: dict, after: dict) -> None:
  """Files are untouched, and nothing is new but (empty) directories a command would have used."""
  assert {k: v for k, v in after.items() if k in before} == before
  new = {k: v for k, v in after.items() if k not in before}
  assert all(content is None for content in new.values()), new  # Directories, no files.
  assert not any(os.path.basename(k) == 'checkpoints' for k in new), new


# docs/bad_inputs.md: a table per command, `argv` | exit status | `message`, rows in order.

def all_rows() -> dict[str, list]:
  return {'engine.main': BAD_INPUTS, **COMMAND_ROWS}


NO_FLAGS = '(no flags)'


def _cell(text: str) -> str:
  escaped = text.replace('|', r'\|')  # A | inside a table cell, even in code, is escaped.
  return f'`{escaped}`'


def _header(program: str) -> str:
  return f'| given (after `python -m {program}`) | exit | the `error:` line |'


def bad_inputs_tables() -> str:
  """The tables docs/bad_inputs.md holds."""
  parts = []
  for program, rows in all_rows().items():
    lines = [f'### `{program}` ({len(rows)} rows)', '', _header(program), '|---|---|---|']
    lines += [f'| {_cell(" ".join(argv) or NO_FLAGS)} | {code} | {_cell(message)} |'
              for argv, code, message in rows]
    parts.append('\n'.join(lines))
  return '\n\n'.join(parts)


def doc_rows() -> dict[str, list]:
  """docs/bad_inputs.md's rows, by the program their table's header names."""
  with open(BAD_INPUTS_DOC) as f:
    text = f.read()
  rows, program = {}, None
  for line in text.splitlines():
    header = re.match(r'^\| given \(after `python -m ([\w.]+)`\)', line)
    if header:
      program = header.group(1)
      rows[program] = []
      continue
    if not line.startswith('|') or line.startswith('|---'):
      continue
    cells = [c.strip() for c in re.split(r'(?<!\\)\|', line)[1:-1]]
    assert len(cells) == 3, line
    given, code, message = (c.strip('`').replace('\\|', '|') for c in cells)
    rows[program].append(([] if given == NO_FLAGS else given.split(' '), int(code), message))
  return rows


if __name__ == '__main__':
  print(bad_inputs_tables())
