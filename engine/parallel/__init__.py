"""Train-step builders, one per parallelism mode: a plain dict registry.

Each builder takes an engine.state.TrainSetup and returns engine.parallel.steps.Steps.

  steps.py            what every builder returns, and what both modes share
  auto.py             auto mode: jax.jit with NamedShardings
  manual.py           manual mode: jax.shard_map, every collective written
  flat_gather.py      manual FSDP's gathers: a layer's split weights in one all_gather
  context.py          ring attention over the context axis (manual mode)
  expert_exchange.py  the experts' token exchange over the expert axis, all_to_all (manual mode)
  pipeline.py         the GPipe and circular pipeline schedules of both modes
"""

from engine.errors import ConfigError
from engine.parallel import auto, manual

STEP_BUILDERS = {'auto': auto.build_steps, 'manual': manual.build_steps}


def check_modes(modes, where: str = 'parallelism.mode') -> None:
  """Every command that takes a mode (a config key, a --modes flag) checks it here."""
  unknown = [mode for mode in ([modes] if isinstance(modes, str) else modes)
             if mode not in STEP_BUILDERS]
  if unknown:
    raise ConfigError(f'{where}={unknown[0]!r} is unknown; choose one of '
                      f'{sorted(STEP_BUILDERS)}.')
  if not modes:
    raise ConfigError(f'{where} is empty; choose one or more of {sorted(STEP_BUILDERS)}.')
