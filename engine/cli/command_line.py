"""Every command's command line: flags parsed, and bad input reported in one line.

absl and ml_collections report bad flags with tracebacks, usage pages or the config library's
internals; `parse_flags` turns each into one line, `error: ...`, naming the flag and the fix
(exit status 2). The common cases are checked on argv before the experiment file runs; --debug
raises instead, with the traceback. `run_command` is every command's `app.run`: the same
parsing, the libraries' chatter quieted, and the engine's own errors (a bad config, a damaged
checkpoint) as that one line. `--help` prints the command's usage (engine/cli/usage.py) and
exits 0.
"""

import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Sequence

from absl import app, flags
from ml_collections import ConfigDict

from engine import config as config_lib
from engine.errors import CheckpointError, ConfigError
from engine.cli.argv import OVERRIDE, bool_flag, fail, flag_args, flag_value
from engine.cli.config_help import did_you_mean
from engine.cli.usage import show_help
from engine.runtime.library_output import quiet_library_output


@dataclasses.dataclass(frozen=True)
class Command:
  """What the parser needs to know of a command: its name (for help hints) and its required
  flags, with the line that says what each is when it is missing (else the flag's help), and
  the boolean flags that make some of them unnecessary."""
  program: str = 'engine.main'
  required: tuple[str, ...] = ('config', 'workdir')
  missing: tuple[tuple[tuple[str, ...], str], ...] = ()
  waived: tuple[tuple[str, tuple[str, ...]], ...] = ()


MAIN = Command(waived=(('print_config', ('workdir',)),), missing=(
    (('config',), '--config is required: the experiment file, e.g. '
                  '--config=experiments/tiny.py.'),
    (('workdir',), '--workdir is required: the directory for checkpoints and metrics (rerun '
                   'with the same one to resume), e.g. --workdir=/tmp/tiny.'),
    (('config', 'workdir'), '--config and --workdir are required, e.g. python -m engine.main '
                            '--config=experiments/tiny.py --workdir=/tmp/tiny.')))


_HELP = ('--help', '--helpshort', '--helpfull', '--helpxml', '-?')
# What engine.cli.usage answers (--helpxml, for tools, stays absl's).
_SHORT_HELP = ('--help', '-help', '--helpshort', '-helpshort', '-?')
_FULL_HELP = ('--helpfull', '-helpfull')
# Old flag names kept working: {name: [its aliases]} (define_alias).
_ALIASES: dict[str, list[str]] = {}
# With these, argv is not the whole story (flags from files, unknown flags allowed): absl alone.
_NOT_CHECKED = ('--flagfile', '-flagfile', '--undefok', '-undefok')
_TYPE_NAMES = {int: 'an integer', float: 'a number', bool: 'true or false'}


def _debug_requested(argv: Sequence[str]) -> bool:
  return bool_flag(argv, 'debug')


def _chain(error: BaseException) -> list[BaseException]:
  """`error` and the errors it was raised from or while handling, outermost first."""
  chain = [error]
  while True:
    inner = chain[-1].__cause__ or (None if chain[-1].__suppress_context__ else
                                    chain[-1].__context__)
    if inner is None:
      return chain
    chain.append(inner)


def innermost(error: BaseException) -> str:
  """The first line of the original error under the wrappers (ml_collections, absl)."""
  error = _chain(error)[-1]
  text = str(error.args[0] if len(error.args) == 1 else error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _example(name: str) -> str:
  """'--name=DEFAULT' for a config key or flag with a default, else ''."""
  if name.startswith('config.'):
    default = config_lib.flat_defaults().get(name.split('.', 1)[1])
  else:
    default = flags.FLAGS[name].default if name in flags.FLAGS else None
  if default is None or isinstance(default, ConfigDict):
    return ''
  return f', e.g. --{name}={str(default).lower() if isinstance(default, bool) else default}'


def _is_flag(name: str) -> bool:
  """Whether --name is a flag: a defined one, a boolean's --noname, or a help flag."""
  if name in flags.FLAGS or f'--{name}' in _HELP:
    return True
  return (name.startswith('no') and name[2:] in flags.FLAGS and
          flags.FLAGS[name[2:]].boolean)


def _check_required(argv: Sequence[str], command: Command) -> None:
  if any(arg.split('=')[0] in _HELP for arg in flag_args(argv)):
    return  # Help needs none.
  waived = {name for flag, names in command.waived if bool_flag(argv, flag) for name in names}
  missing = tuple(name for name in command.required if name not in waived and all(
      flag_value(argv, given) is None for given in (name, *_ALIASES.get(name, ()))))
  if not missing:
    return
  said = dict(command.missing)
  if missing in said:
    raise ConfigError(said[missing])
  # A repeatable flag's help gains a second line from absl: the first says what it is.
  help_text = (flags.FLAGS[missing[0]].help.splitlines()[0].rstrip('.;')
               if missing[0] in flags.FLAGS else '')
  raise ConfigError(f'--{missing[0]} is required' + (f': {help_text}.' if help_text else '.'))


def _check_argv(argv: Sequence[str], command: Command) -> None:
  """The mistakes found on argv alone, before the experiment file runs: an unknown flag, a
  missing flag or experiment file, overrides before --config, keys the config does not have."""
  for arg in flag_args(argv):
    flag = re.match(r'^--?([A-Za-z_][\w.]*)', arg)
    if flag and not (OVERRIDE.match(arg) or _is_flag(flag.group(1))):
      raise flags.UnrecognizedFlagError(flag.group(1), arg)
  _check_required(argv, command)
  experiment = flag_value(argv, 'config')
  if experiment is None or 'config' not in flags.FLAGS:
    return  # Help without an experiment, or a command that takes none.
  path = experiment.split(':', 1)[0]
  fix = 'pass an experiment file, e.g. --config=experiments/tiny.py'
  if not path:
    raise ConfigError(f'--config is empty; {fix}.')
  if os.path.isdir(path):
    raise ConfigError(f'--config={experiment}: {path} is a directory; {fix}.')
  if not os.path.isfile(path):
    raise ConfigError(f'--config={experiment}: {path} does not exist; {fix} (the experiments '
                      'are in experiments/).')
  args = flag_args(argv)
  first_config = min(i for i, arg in enumerate(args) if re.match(r'^--?config(=|$)', arg))
  defaults = config_lib.flat_defaults()
  for i, arg in enumerate(args):
    match = OVERRIDE.match(arg)
    if not match:
      continue
    key = match.group(1)
    if i < first_config:
      raise ConfigError(f'{arg} comes before --config, which it overrides; give '
                        '--config=EXPERIMENT first, then the overrides.')
    if key not in defaults:
      raise ConfigError(f'{arg}: the config has no key {key}{did_you_mean(key, defaults)}; the '
                        'keys and their defaults are in engine/config.py, default_config().')
    if isinstance(defaults[key], ConfigDict):
      first = next(k for k in defaults if k.startswith(key + '.'))
      raise ConfigError(f'{arg}: {key} is a section of the config, not a value; set its keys '
                        f'one by one{_example("config." + first)}.')


def _flag_error(error: Exception, argv: Sequence[str], command: Command) -> str:
  """One line for an error raised while absl parsed `argv` (the experiment file runs then)."""
  if isinstance(error, ConfigError):  # From _check_argv: says it all.
    return str(error)
  experiment = flag_value(argv, 'config')
  raised = [e for e in _chain(error) if isinstance(e, ConfigError)]
  if raised:  # By the experiment file, e.g. a bad experiment argument (ml_collections wraps it).
    return f'--config={experiment}: {raised[-1]}'
  if isinstance(error, flags.UnrecognizedFlagError):
    names = [n for n in flags.FLAGS if not n.startswith('config.') and len(n) > 1]
    close = difflib.get_close_matches(error.flagname, names, n=1)
    hint = f' (did you mean --{close[0]}?)' if close else ''
    keys = ', and config keys are set with --config.KEY=VALUE' if 'config' in flags.FLAGS else ''
    return (f'--{error.flagname} is not a flag{hint}; python -m {command.program} --helpfull '
            f'lists them{keys}.')
  message = str(error)
  missing = re.match(r'Missing value for flag (-+[\w.]+)', message)
  if missing:
    return f'{missing.group(1)} has no value; write {missing.group(1)}=VALUE.'
  bad_value = re.match(r'flag --([\w.]+)=(.*?): ', message)
  if isinstance(error, flags.IllegalFlagValueError) and bad_value:
    name, value = bad_value.group(1), flag_value(argv, bad_value.group(1))
    if name.startswith('config.'):
      kind = type(config_lib.flat_defaults().get(name.split('.', 1)[1]))
    else:
      kind = {'int': int, 'float': float, 'bool': bool}.get(
          flags.FLAGS[name].flag_type() if name in flags.FLAGS else '')
    if kind in _TYPE_NAMES and isinstance(error.__context__, ValueError):
      return f'--{name}={value} is not {_TYPE_NAMES[kind]}; give one{_example(name)}.'
    return f'--{name}={value}: {innermost(error).rstrip(".")}.'
  if isinstance(error, flags.Error):
    return (f'{message.splitlines()[0]}; python -m {command.program} --helpfull lists the '
            'flags.')
  # Anything else was raised while the experiment file ran.
  if isinstance(error, AttributeError) and 'get_config' in str(error):
    return (f'--config={experiment}: the file defines no get_config(); an experiment file '
            'defines get_config(arg=None) returning the config, as experiments/tiny.py does.')
  return (f'--config={experiment} failed to load ({type(error).__name__}: {innermost(error)}); '
          'fix the file, or see the traceback with --debug.')


def parse_flags(argv: Sequence[str], command: Command = MAIN) -> list[str]:
  """absl's flag parsing, with every bad flag (a missing or unreadable experiment file, an
  unknown key, a value of the wrong type) reported in one line, `error: ...`, exit status 2;
  --debug raises instead, with the traceback."""
  asked = [arg for arg in flag_args(argv) if arg in _SHORT_HELP + _FULL_HELP]
  if asked:  # Help, before anything else is read: exit status 0, as a request fulfilled.
    show_help(command.program, full=asked[-1] in _FULL_HELP)
    raise SystemExit(0)
  try:
    if not any(arg.split('=')[0] in _NOT_CHECKED for arg in flag_args(argv)):
      _check_argv(argv, command)
    return flags.FLAGS(list(argv))
  except Exception as error:  # pylint: disable=broad-except
    if _debug_requested(argv):
      raise
    fail(_flag_error(error, argv, command))


def define_alias(old: str, name: str) -> None:
  """--old keeps working as --name (a renamed flag), required-flag checks included."""
  flags.DEFINE_alias(old, name)
  _ALIASES.setdefault(name, []).append(old)


def check_out_directory(path: str | None, flag: str = '--out') -> None:
  """--out=DIR, where a command writes several files: not a file (it is created if missing)."""
  if path is not None and os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'{flag}={path} is a file, not a directory; pass a new path or a '
                      'directory to write into.')


def check_out_prefix(prefix: str | None, flag: str = '--out') -> None:
  """--out=PREFIX writes PREFIX.md and PREFIX.json at the end: its directory must exist and be
  writable before hours of measuring, not after."""
  if prefix is None:
    return
  directory = os.path.dirname(os.path.abspath(prefix)) if prefix else ''
  if not prefix or prefix.endswith(os.sep) or os.path.isdir(prefix):
    raise ConfigError(f'{flag}={prefix} is not a file prefix; give one, e.g. {flag}=/tmp/report '
                      'for /tmp/report.md and /tmp/report.json.')
  if not os.path.isdir(directory):
    raise ConfigError(f'{flag}={prefix}: {directory} is not a directory; create it, or pass a '
                      'prefix in one.')
  if not os.access(directory, os.W_OK):
    raise ConfigError(f'{flag}={prefix}: {directory} cannot be written (permissions); pass a '
                      'prefix in a writable directory.')


# The engine's own errors, which say everything in one line (a traceback would bury it).
EXPLAINED_ERRORS = (ConfigError, CheckpointError)


def run_command(main, program: str, required: tuple[str, ...] = ()) -> None:
  """`app.run(main)` for a command other than engine.main: its flags through parse_flags, the
  libraries' chatter quieted, and a ConfigError or CheckpointError as one `error:` line."""

  def wrapped(argv):
    if len(argv) > 1:
      fail(f'unexpected arguments {argv[1:]}; everything is given as a flag, --name=value.')
    quiet_library_output()
    try:
      main(argv)
    except EXPLAINED_ERRORS as error:
      fail(str(error))

  app.run(wrapped, flags_parser=functools.partial(
      parse_flags, command=Command(program, tuple(required))))


def add_bos_flag():
  """--add_bos, which engine.generate and engine.evaluate share."""
  return flags.DEFINE_bool(
      'add_bos', True, 'Start the tokens with the tokenizer\'s beginning-of-text id, if it has '
      'one, as each training document does (engine.data.prepare); --noadd_bos: do not.')
