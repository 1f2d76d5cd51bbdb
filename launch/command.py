"""What every launcher shares: its argument parser, the command to run (given after `--`) and
the checks that refuse bad input in one line, `error: ...`, exit status 2, before anything
starts."""

from __future__ import annotations

import argparse
import os
import shutil
from typing import NoReturn

from engine.cli.argv import fail


class Parser(argparse.ArgumentParser):
  """argparse, with its usage errors as one line naming the launcher's --help (not a usage
  page)."""

  def __init__(self, program: str, description: str):
    super().__init__(prog=f'python -m {program}', description=description,
                     formatter_class=argparse.RawDescriptionHelpFormatter)

  def error(self, message: str) -> NoReturn:
    fail(f'{message}; {self.prog} --help lists the flags.')


def add_command_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('command', nargs=argparse.REMAINDER, help='The command to run, after --.')


def command_after_dashes(args) -> list[str]:
  """The command given after `--`; a usage error if there is none."""
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    fail('give the command to run after --, e.g. -- python -m engine.main '
         '--config=experiments/tiny.py --workdir=/tmp/tiny.')
  return command


def check_at_least(args, minimum: float, *names: str) -> None:
  """Each --name's value must be >= minimum."""
  for name in names:
    value = getattr(args, name)
    if value < minimum:
      fail(f'--{name}={value:g} must be >= {minimum:g}.')


def check_program(command: list[str]) -> None:
  """The command's program must be one this machine can run (a traceback from the process
  launch would say less, later)."""
  program = command[0]
  if os.sep in program:
    if not (os.path.isfile(program) and os.access(program, os.X_OK)):
      fail(f'{program} (the command after --) is not an executable file; check the path, e.g. '
           '-- python -m engine.main ...')
  elif shutil.which(program) is None:
    fail(f'{program} (the command after --) is not a program on PATH; check its name, e.g. -- '
         'python -m engine.main ...')


def check_tool(tool: str, what: str) -> None:
  """A cluster's own command (sbatch, gcloud) must be on PATH unless the run is a dry run."""
  if shutil.which(tool) is None:
    fail(f'{tool} is not on PATH: {what}; or pass --dry_run to print what would run.')
