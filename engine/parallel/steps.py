"""What every step builder returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Steps:
  """Jitted (or jit-wrapped shard_map) functions on the sharded train state.

  train(state, tokens_BL1) -> (new state, {'loss', 'grad_norm'}); the state is donated.
  eval(params, tokens_BL1) -> mean loss.
  """
  train: Callable
  eval: Callable
