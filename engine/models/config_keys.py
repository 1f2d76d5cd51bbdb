"""How a model declares the `model.*` keys only it reads, and checks their values.

engine/config.py's schema merges every model's keys (engine/models/__init__.py: MODEL_KEYS), and
engine.validation calls the configured model's check (MODEL_CHECKS), turning a ModelConfigError
into the engine's ConfigError with the same one-line message. No JAX here: engine.config builds
the schema where JAX is never imported (the launchers).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class ConfigKey:
  """One `model.<name>` key: its default and the line of help `--print_config` shows. The default
  is what the model computed before the key existed: a run's config.json written before it gains
  the key at its default when read back (engine/workdir/run_dir.py, `upgrade`)."""
  name: str
  default: object
  help: str
  # Another model, which would silently ignore the key, refuses any value but the default.
  exclusive: bool = False


class ModelConfigError(ValueError):
  """A model key's value that cannot work; the message names the key and the fix."""


def choose(model, name: str, choices) -> None:
  if model[name] not in choices:
    raise ModelConfigError(f'model.{name}={model[name]!r} is unknown; choose one of {choices}.')


def require_positive(model, names) -> None:
  for name in names:
    if model[name] <= 0:
      raise ModelConfigError(f'model.{name}={model[name]} must be positive.')


def require_finite(model, names) -> None:
  for name in names:
    if not math.isfinite(model[name]):
      raise ModelConfigError(f'model.{name}={model[name]} is not a finite number; give one.')
