"""Train-step builders, one per parallelism mode: a plain dict registry.

Each builder takes an engine.state.TrainSetup and returns engine.parallel.steps.Steps.
"""

from engine.parallel import auto, manual

STEP_BUILDERS = {'auto': auto.build_steps, 'manual': manual.build_steps}
