"""Text files a user names (data.path, --text_file, --prompts_file): checked and read with one
line for each way they can be wrong, naming the setting that gave them."""

from __future__ import annotations

import os

from engine.errors import ConfigError


def check_file(path: str, what: str, fix: str) -> None:
  """Raises ConfigError unless `path` is a readable file; `what` names it (e.g.
  "data.path='x.txt'"), `fix` says what to do instead."""
  if os.path.isdir(path):
    raise ConfigError(f'{what} is a directory, not a file; {fix}')
  if not os.path.isfile(path):
    raise ConfigError(f'{what} does not exist; {fix}')
  if not os.access(path, os.R_OK):
    raise ConfigError(f'{what} cannot be read (permissions); {fix}')


def read_text(path: str, what: str, fix: str = 'pass another file') -> str:
  """The file's text, after check_file; a file that is not UTF-8 is refused naming its first
  bad byte."""
  check_file(path, what, fix + '.')
  with open(path, 'rb') as f:
    raw = f.read()
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError as error:
    line = raw.count(b'\n', 0, error.start) + 1
    column = error.start - (raw.rfind(b'\n', 0, error.start) + 1) + 1
    raise ConfigError(
        f'{what} is not UTF-8 text: byte {error.start} (0x{raw[error.start]:02x}, line {line}, '
        f'column {column}) is not valid UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 '
        f'-t utf-8) or {fix}.') from None
