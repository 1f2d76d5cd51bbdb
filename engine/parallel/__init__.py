"""Every compiled program on a layout. Train-step builders, one per parallelism mode: a plain
dict registry; each takes an engine.state.TrainSetup and returns engine.parallel.steps.Steps.
`build_steps(mode, setup)` is where a mode picks its builder: the mode is an argument, never
read from a config here.

  steps.py            Steps (train, eval, gradients, window losses) and the loss both modes share
  auto.py             auto mode: jax.jit with shardings from the rules (AutoOps)
  manual.py           manual mode: the step inside shard_map, its gradients synchronised
  manual_ops.py       manual mode's operations, every collective written (ManualOps)
  decode.py           generation's cached-attention ops (DecodeOps), compiled prefill and decode
  context.py          manual context parallelism: the split sequence, ring attention
  pipeline/           pipeline stages over `stage`, in either mode: GPipe, circular, 1F1B,
                      interleaved 1F1B and zero-bubble (its own map)
  flat_gather.py      manual FSDP's gathers, one collective per group of weights
  quantized_gather.py manual FSDP's gathers in int8 / fp8, one scale per channel
  expert_exchange.py  manual expert parallelism: the experts' token exchange (all_to_all)
  zero1.py            manual ZeRO-1: gradients reduce-scattered to the moments' blocks, the
                      updated parameter blocks all-gathered
  muon_blocks.py      manual Muon: each split matrix gathered whole for Newton-Schulz, cut back
"""

from engine.errors import ConfigError
from engine.parallel import auto, manual
from engine.parallel.steps import Steps

STEP_BUILDERS = {'auto': auto.build_steps, 'manual': manual.build_steps}


def build_steps(mode: str, setup) -> Steps:
  """`mode`'s jitted steps on `setup` (an engine.state.TrainSetup); an unknown mode is refused
  as check_modes refuses it."""
  check_modes(mode)
  return STEP_BUILDERS[mode](setup)


def check_modes(modes, where: str = 'parallelism.mode') -> None:
  """Every command that takes a mode (a config key, a --modes flag) checks it here."""
  unknown = [mode for mode in ([modes] if isinstance(modes, str) else modes)
             if mode not in STEP_BUILDERS]
  if unknown:
    raise ConfigError(f'{where}={unknown[0]!r} is unknown; choose one of '
                      f'{sorted(STEP_BUILDERS)}.')
  if not modes:
    raise ConfigError(f'{where} is empty; choose one or more of {sorted(STEP_BUILDERS)}.')
