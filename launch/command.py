"""What every launcher shares: the command to run, given after `--`."""

from __future__ import annotations

import argparse


def add_command_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('command', nargs=argparse.REMAINDER, help='The command to run, after --.')


def command_after_dashes(parser: argparse.ArgumentParser, args) -> list[str]:
  """The command given after `--`; a usage error if there is none."""
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not command:
    parser.error('give the command to run after --, e.g. -- python -m engine.main ...')
  return command
