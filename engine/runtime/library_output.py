"""Keeping the console readable: the short log lines (log_format.py), and the libraries' INFO
chatter and the tracebacks they print for failures the engine reports itself in one line
(`--debug` keeps everything). Every command sets its console up here, through
quiet_library_output."""

from __future__ import annotations

import logging as std_logging
import os
import sys
import threading

from absl import logging

from engine.runtime.log_format import use_short_format


# Library warnings about what the engine asked for on purpose. Orbax warns on every read-only
# checkpoint manager (the one that restores parameters for generate, evaluate and export).
_KNOWN_HARMLESS = ('Given directory is read only=',)


def quiet_library_output(debug: bool = False) -> None:
  """Drops the INFO chatter of Orbax and grain (they log through absl) so progress stays
  readable; their warnings and errors still show, but for the few _KNOWN_HARMLESS ones. Unless
  `debug`, also drops the tracebacks that a failed checkpoint write makes Orbax log and
  tensorstore print: the engine's own error line names the step and the cause. Log lines take
  the short format (log_format.py)."""
  use_short_format()

  def from_library(record) -> bool:
    return any(f'{os.sep}{lib}{os.sep}' in record.pathname for lib in ('orbax', 'grain'))

  def keep(record) -> bool:
    if from_library(record) and record.getMessage().startswith(_KNOWN_HARMLESS):
      return False
    if not debug and from_library(record):
      record.exc_info, record.exc_text = None, None  # The message line stays.
    if not debug and record.name == 'asyncio' and 'orbax' in record.getMessage():
      return False  # "Task exception was never retrieved": one per abandoned Orbax write.
    return record.levelno >= std_logging.WARNING or not from_library(record)

  handler = logging.get_absl_handler()
  for old in [f for f in handler.filters if getattr(f, 'engine_filter', False)]:
    handler.removeFilter(old)  # Called again (tests run main many times): replace, not pile up.
  keep.engine_filter = True
  handler.addFilter(keep)
  if not debug and not isinstance(sys.stderr, _DropClosedLoopTracebacks):
    sys.stderr = _DropClosedLoopTracebacks(sys.stderr)


class _DropClosedLoopTracebacks:
  """stderr, less one kind of traceback. When one write of an Orbax save fails, Orbax closes its
  event loop while tensorstore still has writes in flight; each of them then prints a traceback
  ending in 'RuntimeError: Event loop is closed' (dozens, from several threads at once, burying
  the real error). Each thread's traceback is held until its last line shows which kind it is;
  all other output passes unchanged."""

  _HEADER = 'Traceback (most recent call last):\n'
  _DROPPED = 'RuntimeError: Event loop is closed'

  def __init__(self, stream):
    self._stream = stream
    self._held: dict[int, str] = {}  # By thread: the traceback it is printing.

  def write(self, text: str) -> int:
    thread = threading.get_ident()
    held = self._held.get(thread, '')
    if not held and not text.startswith(self._HEADER):
      return self._stream.write(text)
    held += text
    lines = held.split('\n')
    if len(lines) > 1 and lines[-2] and not lines[-2].startswith((' ', 'Traceback')):
      del self._held[thread]  # Its exception line is complete.
      if lines[-2] != self._DROPPED:
        self._stream.write(held)
    else:
      self._held[thread] = held
    return len(text)

  def flush(self) -> None:
    self._stream.flush()

  def __getattr__(self, name):
    return getattr(self._stream, name)
