"""The tiny test model as an experiment file, for runs started as separate processes.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- python -m engine.main \
      --config=tests/multihost_experiment.py:mesh=2x2x2,mode=manual,steps=4 --workdir=DIR
"""

from engine.config import parse_arg, set_mesh_shape
from tests.helpers import tiny_config


def get_config(arg=None):
  args = parse_arg(arg, mesh='2x2x2', mode='auto', steps=4, checkpoint_every=2, decay_steps=8,
                   dcn_data=1)
  config = tiny_config(steps=args.steps)
  set_mesh_shape(config, args.mesh)
  config.parallelism.mode = args.mode
  config.train.checkpoint_every = args.checkpoint_every
  config.mesh.dcn_data = args.dcn_data
  config.optim.decay_steps = args.decay_steps  # Independent of where a run stops, for resumes.
  return config
