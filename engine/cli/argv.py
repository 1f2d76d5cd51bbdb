"""A command line read as text, before or without a flag parser, and the one line that ends it.

engine.cli.command_line checks argv before absl runs the experiment file, engine.sweep passes its
own --config.KEY=VALUE flags on to every variant, and the launchers (launch/) read the engine
command they start: all three read flags here, the way absl does (--name=value or --name value,
one dash or two, the last one given, nothing after a lone '--'). `fail` is the `error: ...` line
every command and launcher ends with on bad input. Standard library only: a launcher that
imports this starts neither JAX nor the flag libraries.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import NoReturn

# A config override, --config.KEY=VALUE (--noconfig.KEY for a boolean); group 1 is KEY.
OVERRIDE = re.compile(r'^--?(?:no)?config\.([^=]*)')


def fail(message: str, code: int = 2) -> NoReturn:
  """Ends the run with one line naming the problem and the fix; a traceback would bury it."""
  print(f'error: {message}', file=sys.stderr)
  sys.exit(code)


def flag_args(argv: Sequence[str]) -> list[str]:
  """The arguments absl reads as flags: those after the program (argv[0]) and before a lone
  '--'."""
  args = list(argv[1:])
  return args[:args.index('--')] if '--' in args else args


def flag_value(argv: Sequence[str], name: str) -> str | None:
  """The last value given to --name (as --name=value or --name value), else None; '' for a
  --name with nothing after it."""
  value, args = None, flag_args(argv)
  for i, arg in enumerate(args):
    if re.match(rf'^--?{re.escape(name)}=', arg):
      value = arg.split('=', 1)[1]
    elif re.match(rf'^--?{re.escape(name)}$', arg):
      value = args[i + 1] if i + 1 < len(args) else ''
  return value


def bool_flag(argv: Sequence[str], name: str) -> bool:
  """Whether the boolean flag --name is true on argv (the last of --name, --noname, --name=X)."""
  value = False
  for arg in flag_args(argv):
    if arg in (f'--{name}', f'-{name}'):
      value = True
    elif arg in (f'--no{name}', f'-no{name}'):
      value = False
    elif re.match(rf'^--?{re.escape(name)}=', arg):
      value = arg.split('=', 1)[1].lower() in ('true', 't', '1')
  return value


def config_overrides(argv: Sequence[str]) -> list[str]:
  """The --config.KEY=VALUE flags on argv, in order, each as one argument (a value given as the
  next argument, --config.KEY VALUE, joined to its flag)."""
  args, found = flag_args(argv), []
  for i, arg in enumerate(args):
    if not OVERRIDE.match(arg):
      continue
    following = args[i + 1] if i + 1 < len(args) else '-'
    found.append(arg if '=' in arg or following.startswith('-') else f'{arg}={following}')
  return found
