"""The console's log lines: `I 12:03:04 message` (level letter, local time, message) for the
engine's own, and the same with the file and line that spoke for a library's
(`W 12:03:04 checkpoint_manager.py:1021] message`): absl's full prefix
(`I1205 12:03:04.123456 140234 file.py:123] `, about 60 characters) buries the message. Under
--verbosity=1 or more (debugging) absl's full format comes back, thread id and microseconds
included.
"""

from __future__ import annotations

import logging as std_logging
import os
import time

from absl import logging

_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class ShortFormatter(std_logging.Formatter):
  """`L HH:MM:SS message`, the source added for lines that are not the engine's."""

  def format(self, record: std_logging.LogRecord) -> str:
    letter = record.levelname[:1] if record.levelno < std_logging.CRITICAL else 'F'
    line = f'{letter} {time.strftime("%H:%M:%S", time.localtime(record.created))} '
    if not record.pathname.startswith(_ENGINE_DIR):
      line += f'{os.path.basename(record.pathname)}:{record.lineno}] '
    line += record.getMessage()
    if record.exc_info and not record.exc_text:
      record.exc_text = self.formatException(record.exc_info)
    if record.exc_text:
      line += '\n' + record.exc_text
    return line


def use_short_format() -> None:
  """The absl handler (every command's log lines) writes ShortFormatter's lines, unless
  --verbosity is 1 or more, when it keeps (or goes back to) absl's own format."""
  handler = logging.get_absl_handler()
  if logging.get_verbosity() >= 1:
    handler.setFormatter(logging.PythonFormatter())
  else:
    handler.setFormatter(ShortFormatter())
