"""What transformers says while a child process works: its logger's warnings, Python warnings and
anything it prints, collected instead of shown. Shared by the child scripts that run under a
Python with transformers (hf_reference.py, tokenizer_reference.py), which import it as a sibling
file; it imports neither jax nor anything from `engine`."""

import contextlib
import io
import logging
import re
import warnings

_ANSI = re.compile(r'\x1b\[[0-9;]*m')  # transformers' load report is in bold.


@contextlib.contextmanager
def captured_warnings():
  """Collects what transformers says (logger records >= WARNING, Python warnings, prints) into
  the yielded list; nothing reaches this process's stdout, which carries the protocol."""
  said = []

  class Handler(logging.Handler):

    def emit(self, record):
      said.append(f'{record.levelname}: {record.getMessage()}')

  handler = Handler(logging.WARNING)
  logger = logging.getLogger('transformers')
  logger.addHandler(handler)
  printed = io.StringIO()
  try:
    with warnings.catch_warnings(record=True) as caught, \
        contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
      warnings.simplefilter('always')
      yield said
  finally:
    logger.removeHandler(handler)
  said.extend(f'{w.category.__name__}: {w.message}' for w in caught)
  said.extend(line for line in printed.getvalue().splitlines() if line.strip())
  said[:] = [_ANSI.sub('', text) for text in said]
