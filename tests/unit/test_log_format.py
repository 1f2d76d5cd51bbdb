"""The short log lines (engine/runtime/log_format.py): `I 12:03:04 message` for the engine's own,
the file and line added for a library's, absl's full format under --verbosity=1. The commands'
own stderr in that format: tests/commands/test_cli.py."""

import logging as std_logging
import os
import re
import sys
import time

from absl import logging

import engine
from engine.runtime import log_format

ENGINE_FILE = os.path.join(os.path.dirname(os.path.abspath(engine.__file__)), 'train', 'loop.py')
LIBRARY_FILE = os.path.join(os.sep, 'site-packages', 'orbax', 'checkpoint', 'manager.py')


def _record(pathname, level=std_logging.INFO, message='Mesh %s', args=('2x2x2',), exc_info=None):
  record = std_logging.LogRecord('absl', level, pathname, 164, message, args, exc_info)
  record.created = time.mktime((2026, 12, 5, 12, 3, 4, 0, 0, -1)) + 0.25
  return record


def test_the_engines_lines_are_level_time_message():
  short = log_format.ShortFormatter()
  assert short.format(_record(ENGINE_FILE)) == 'I 12:03:04 Mesh 2x2x2'
  assert short.format(_record(ENGINE_FILE, std_logging.WARNING)) == 'W 12:03:04 Mesh 2x2x2'
  assert short.format(_record(ENGINE_FILE, std_logging.CRITICAL)) == 'F 12:03:04 Mesh 2x2x2'


def test_a_librarys_lines_name_the_file_that_spoke():
  line = log_format.ShortFormatter().format(_record(LIBRARY_FILE, std_logging.WARNING))
  assert line == 'W 12:03:04 manager.py:164] Mesh 2x2x2'


def test_a_logged_exception_keeps_its_traceback():
  try:
    raise ValueError('bad shard')
  except ValueError:
    record = _record(ENGINE_FILE, std_logging.ERROR, 'failed', (), sys.exc_info())
  lines = log_format.ShortFormatter().format(record).splitlines()
  assert lines[0] == 'E 12:03:04 failed'
  assert lines[1] == 'Traceback (most recent call last):' and lines[-1] == 'ValueError: bad shard'


def test_verbosity_one_keeps_absls_full_format():
  handler = logging.get_absl_handler()
  saved_formatter, saved_verbosity = handler.python_handler.formatter, logging.get_verbosity()
  record = _record(ENGINE_FILE)
  try:
    log_format.use_short_format()
    assert handler.format(record) == 'I 12:03:04 Mesh 2x2x2'
    logging.set_verbosity(1)
    log_format.use_short_format()
    # absl's own: I1205 12:03:04.250000 <thread> loop.py:164] Mesh 2x2x2
    assert re.fullmatch(r'I1205 12:03:04\.250000 +\d+ loop\.py:164\] Mesh 2x2x2',
                        handler.format(record)), handler.format(record)
  finally:
    logging.set_verbosity(saved_verbosity)
    handler.setFormatter(saved_formatter)
