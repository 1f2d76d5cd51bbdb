"""Runs many command lines (`python -m PROGRAM ARGV`) quickly: one process imports JAX and the
engine once, then runs each command line in a forked child of itself, as `python -m` would
(runpy, `__name__ == '__main__'`, absl's app.run), with its output captured and the XLA compiles
it made counted.

A fresh `python -m` costs 1.5-2.5 s of imports on the test machines; a fork costs milliseconds,
so the bad-input table can try every command's rows. JAX's backend is never started in the
parent, so each child starts its own (forking a started backend's threads would be unsafe).

  python -m tests.support.forked_commands < rows.json > results.json

rows.json: [{"program": "engine.generate", "argv": [...], "cwd": "...", "env": {optional
environment variables, set before the child's backend starts}}, ...]; each result:
{"code": exit status, "output": stdout and stderr, "compiles": XLA compiles, "seconds": wall
time}.
"""

import json
import os
import signal
import sys
import tempfile
import time

# Imported once here, inherited by every child: the commands' libraries, but no command module
# (each defines its flags on import: running it as __main__ would define them twice).
import jax
import numpy  # noqa: F401
from engine import assemble  # noqa: F401
from engine.export import exporter as export
from engine.evaluate import scoring as evaluate
from engine.cli import command_line as cli
from engine.generate import sampling as generate
from engine.plan import planner as plan
from engine.analysis.compare import comparison  # noqa: F401
from engine.analysis.hf_check import checker as hf_checker
from engine.analysis.show_layout import layout
from engine.analysis.tokenizer_check import engine_side as tokenizer_compare
from engine.data import bpe_trainer, shard_writer  # noqa: F401
from engine.sweep import runner  # noqa: F401

COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # One per XLA compile.
TIMEOUT_S = 300


def _child(row: dict, output_fd: int, compiles_path: str) -> None:
  """In the forked child: run the command line as `python -m` would, then report and exit."""
  import runpy  # pylint: disable=g-import-not-at-top
  import warnings  # pylint: disable=g-import-not-at-top
  # runpy warns that the parent imported the program's package (not the program) first.
  warnings.filterwarnings('ignore', message=".*found in sys.modules after import of package")
  signal.alarm(TIMEOUT_S)  # A command that hangs is killed (SIGALRM), and the row fails.
  os.dup2(output_fd, 1)
  os.dup2(output_fd, 2)
  os.chdir(row['cwd'])
  os.environ.update(row.get('env', {}))
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **kw: compiles.append(seconds) if event == COMPILE_EVENT else None)
  sys.argv = [row['program'], *row['argv']]
  code = 0
  try:
    runpy.run_module(row['program'], run_name='__main__', alter_sys=True)
  except SystemExit as exit_:
    code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
  except BaseException:  # pylint: disable=broad-except  (what `python -m` prints, status 1)
    import traceback  # pylint: disable=g-import-not-at-top
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  with open(compiles_path, 'w') as f:
    f.write(str(len(compiles)))
  os._exit(code)  # pylint: disable=protected-access


def run_row(row: dict) -> dict:
  start = time.monotonic()
  with tempfile.TemporaryDirectory() as scratch:
    output_path, compiles_path = f'{scratch}/output', f'{scratch}/compiles'
    output_fd = os.open(output_path, os.O_WRONLY | os.O_CREAT)
    pid = os.fork()
    if pid == 0:
      try:
        _child(row, output_fd, compiles_path)
      finally:
        os._exit(70)  # pylint: disable=protected-access
    os.close(output_fd)
    _, status = os.waitpid(pid, 0)
    with open(output_path) as f:
      output = f.read()
    compiles = int(open(compiles_path).read()) if os.path.exists(compiles_path) else -1
  return {'code': os.waitstatus_to_exitcode(status), 'output': output, 'compiles': compiles,
          'seconds': round(time.monotonic() - start, 1)}


def main() -> None:
  rows = json.load(sys.stdin)
  json.dump([run_row(row) for row in rows], sys.stdout)


if __name__ == '__main__':
  main()
