"""The size and CRC-32 of every file of a checkpoint, recorded when it is written and checked
before it is restored (engine/workdir/checkpoint.py records them just before Orbax's rename), so
that damage done later (a truncated, deleted or altered file) is named by file and cause.
"""

from __future__ import annotations

import json
import zlib

from etils import epath

CHECKSUMS_FILE = 'checksums.json'
# Orbax adds the commit time to this file after the checksums are taken; a damaged copy fails
# to parse on restore instead.
_REWRITTEN_AFTER_COMMIT = ('_CHECKPOINT_METADATA',)


def file_checksums(directory: epath.Path) -> dict[str, list[int]]:
  """{relative path: [size, CRC-32]} of every file under `directory`."""
  sums = {}
  files = [epath.Path(parent) / name for parent, _, names in directory.walk() for name in names
           if name not in _REWRITTEN_AFTER_COMMIT]
  for path in sorted(files):
    crc, size = 0, 0
    with path.open('rb') as f:
      while chunk := f.read(1 << 24):
        crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    sums[str(path.relative_to(directory))] = [size, crc]
  return sums


def find_damage(directory: epath.Path) -> str | None:
  """Why the checkpoint in `directory` is damaged, or None if every recorded file is intact."""
  record = directory / CHECKSUMS_FILE
  if not record.exists():
    return (f'{CHECKSUMS_FILE} is missing, so nothing in it can be trusted (deleted, or the '
            'checkpoint was cut short)')
  try:
    expected = json.loads(record.read_text())
  except (ValueError, UnicodeDecodeError):
    return f'{CHECKSUMS_FILE} is not valid JSON'
  found = file_checksums(directory)
  for name, (size, crc) in expected.items():
    if name not in found:
      return f'{name} is missing'
    if found[name][0] != size:
      return f'{name} has {found[name][0]} bytes, {size} were written'
    if found[name][1] != crc:
      return f'{name} has the right size but different bytes (checksum mismatch)'
  return None
