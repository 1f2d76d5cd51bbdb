"""WORKDIR/metrics.jsonl, the run's record: every train.loggers list has it (summary.json, the loss
curve and sweeps read it back)."""

from __future__ import annotations

import json
import time

from absl import logging
from etils import epath

from engine.loggers.base import Logger
from engine.workdir import run_dir as workdir_lib

FILE = 'metrics.jsonl'


class JsonLines(Logger):
  """metrics.jsonl: one JSON object per line, written as they come.

  Lines of steps after `start_step` (logged by an earlier attempt of a resumed run) are dropped
  first, atomically, since those steps run again. Local files are appended to; object stores
  cannot append, so there the file is rewritten whole, at most every `remote_every_s` seconds
  and on close."""

  def __init__(self, workdir: epath.Path, start_step: int, config=None,
               remote_every_s: float = 60.0):
    super().__init__(workdir, start_step, config)
    path = self.path = workdir / FILE
    self.remote = workdir_lib.is_remote(path)
    self.remote_every_s = remote_every_s
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    self.lines = [line for line in lines if line.strip() and json.loads(line)['step'] <= start_step]
    if len(self.lines) < len(lines):
      workdir_lib.write_text_atomically(path, ''.join(self.lines))
      logging.info('Dropped %d lines of %s logged after step %d: those steps run again.',
                   len(lines) - len(self.lines), path, start_step)
    self._file = None if self.remote else path.open('a')
    self._written_at = time.monotonic()

  def write(self, step: int, scalars: dict[str, float]) -> None:
    line = json.dumps({'step': step, **scalars}) + '\n'
    if self._file is not None:
      self._file.write(line)
      self._file.flush()
      return
    self.lines.append(line)
    if time.monotonic() - self._written_at > self.remote_every_s:
      self._rewrite()

  def _rewrite(self) -> None:
    self.path.write_text(''.join(self.lines))
    self._written_at = time.monotonic()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    else:
      self._rewrite()
