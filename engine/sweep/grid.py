"""engine.sweep's grid: the --grid flags parsed, every combination named, each variant's config
built and its command line written; bad input is a ConfigError naming the flag or the variant.

`mode` is short for parallelism.mode and `mesh` for the six mesh axes (engine.config.parse_mesh);
any other key is a config key (engine/config.py, default_config()).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
import sys

import ml_collections
from ml_collections import ConfigDict

from engine import config as config_lib
from engine.errors import ConfigError
from engine.cli.config_help import did_you_mean

SHORT_KEYS = {'mode': 'parallelism.mode'}  # And 'mesh': all six mesh axes.
_UNSAFE = re.compile(r'[^A-Za-z0-9._=,+-]')  # Kept out of variant names (directory names).


@dataclasses.dataclass(frozen=True)
class Variant:
  name: str  # Its workdir's name under --workdir, e.g. 'mode=auto,optim.learning_rate=1e-3'.
  values: tuple[tuple[str, str], ...]  # (grid key, value) in the order of the --grid flags.
  overrides: tuple[str, ...]  # Its --config.KEY=VALUE flags, after the sweep's own.


def parse_grid(flags_given: list[str]) -> list[tuple[str, list[str]]]:
  """[(key, [values])] from the --grid=KEY=V1,V2,... flags; raises on a malformed one."""
  if not flags_given:
    raise ConfigError('give at least one --grid=KEY=V1,V2,..., e.g. '
                      '--grid=optim.learning_rate=1e-3,3e-3.')
  defaults, grid = config_lib.flat_defaults(), []
  for flag in flags_given:
    key, sep, text = flag.partition('=')
    if not sep or not key:
      raise ConfigError(f'--grid={flag} is not KEY=V1,V2,...; e.g. '
                        '--grid=optim.learning_rate=1e-3,3e-3.')
    if key != 'mesh' and key not in SHORT_KEYS:
      if key not in defaults:
        raise ConfigError(f'--grid={flag}: the config has no key {key}'
                          f'{did_you_mean(key, defaults)}; the keys are in engine/config.py, '
                          'default_config() (and mode, mesh).')
      if isinstance(defaults[key], ConfigDict):
        raise ConfigError(f'--grid={flag}: {key} is a section of the config, not a value; '
                          'sweep its keys one by one.')
    if any(key == seen for seen, _ in grid):
      raise ConfigError(f'--grid: {key} is given twice; give all its values in one flag, '
                        f'--grid={key}=V1,V2,....')
    values = text.split(',')
    if '' in values:
      raise ConfigError(f'--grid={flag} has an empty value; list values separated by single '
                        f'commas, e.g. --grid={key}=A,B.')
    if len(set(values)) != len(values):
      raise ConfigError(f'--grid={flag} lists a value twice; list each value once.')
    if key == 'mesh':
      for value in values:
        config_lib.parse_mesh(value, '--grid: mesh')
    grid.append((key, values))
  return grid


def _overrides(key: str, value: str) -> list[str]:
  if key == 'mesh':
    return [f'--config.mesh.{axis}={size}'
            for axis, size in config_lib.parse_mesh(value).items()]
  return [f'--config.{SHORT_KEYS.get(key, key)}={value}']


def variants(grid: list[tuple[str, list[str]]]) -> list[Variant]:
  """Every combination, the first flag's values varying slowest; names must stay distinct."""
  found, names = [], {}
  for combination in itertools.product(*[[(key, v) for v in values] for key, values in grid]):
    name = _UNSAFE.sub('_', ','.join(f'{key}={value}' for key, value in combination))
    if name in names:
      raise ConfigError(f'--grid: the variants {names[name]} and {combination} would share the '
                        f'workdir {name}; give values that differ in letters or digits.')
    names[name] = combination
    overrides = [flag for key, value in combination for flag in _overrides(key, value)]
    found.append(Variant(name, tuple(combination), tuple(overrides)))
  return found


def _typed(current, key: str, value: str):
  """`value` as the type of the config's current value (what --config.KEY=VALUE would give)."""
  try:
    if isinstance(current, bool):
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(value)
      return value.lower() in ('true', '1')
    if isinstance(current, (int, float)):
      return type(current)(value)
  except ValueError:
    kind = {bool: 'true or false', int: 'an integer', float: 'a number'}[type(current)]
    example = str(current).lower() if isinstance(current, bool) else current
    raise ConfigError(f'--grid: {key}={value} is not {kind}; give values of the key\'s type, '
                      f'e.g. {key}={example}.') from None
  return value


def variant_config(base: ml_collections.ConfigDict, variant: Variant) -> ml_collections.ConfigDict:
  """A copy of the base config (experiment and the sweep's --config.* flags) with the variant's
  values; the base is left as it was, for the next variant."""
  values = {}
  for key, value in variant.values:
    if key == 'mesh':
      values.update(config_lib.mesh_values(value))
      continue
    *sections, leaf = SHORT_KEYS.get(key, key).split('.')
    section = base
    for name in sections:
      section = section[name]
    values[SHORT_KEYS.get(key, key)] = _typed(section.get(leaf), key, value)
  return config_lib.with_values(base, values)


def command(experiment: str, base_overrides: list[str], variant: Variant,
            workdir: str) -> list[str]:
  """The variant's engine.main command line."""
  return [sys.executable, '-m', 'engine.main', f'--config={experiment}', *base_overrides,
          *variant.overrides, f'--workdir={workdir}']


def already_finished(record: dict, command: list[str]) -> bool:
  """Whether sweep.json's record says this very command ran to its end. Another command (more
  steps, say) runs again: engine.main extends the run, or refuses in one line."""
  return record.get('status') == 'finished' and record.get('command') == shlex.join(command)
