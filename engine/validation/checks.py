"""The one wording of the small checks every section makes, each raising ConfigError."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine.errors import ConfigError


def require_positive(section: ConfigDict, prefix: str, names: list[str]) -> None:
  for name in names:
    if section[name] <= 0:
      raise ConfigError(f'{prefix}.{name}={section[name]} must be positive.')


def require_divisible(value: int, value_key: str, by: int, by_name: str) -> None:
  if value % by:
    raise ConfigError(
        f'{value_key}={value} is not divisible by {by_name}={by}; change one of them so that '
        f'{by_name} divides {value_key}.')


def choose(section: ConfigDict, name: str, key: str, choices) -> None:
  if section[name] not in choices:
    raise ConfigError(f'{key}={section[name]!r} is unknown; choose one of {choices}.')


def require_finite(section: ConfigDict, prefix: str, names: list[str]) -> None:
  for name in names:
    if not math.isfinite(section[name]):
      raise ConfigError(f'{prefix}.{name}={section[name]} is not a finite number; give one.')


def require_non_negative(section: ConfigDict, prefix: str, names: list[str]) -> None:
  for name in names:
    if section[name] < 0:
      raise ConfigError(f'{prefix}.{name}={section[name]} must be >= 0.')
