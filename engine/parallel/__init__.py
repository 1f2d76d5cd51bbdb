"""Train-step builders, one per parallelism mode: a plain dict registry.

Each builder takes an engine.state.StateLayout and returns engine.parallel.steps.Steps.
"""

from engine.parallel import auto

STEP_BUILDERS = {'auto': auto.build_steps}
