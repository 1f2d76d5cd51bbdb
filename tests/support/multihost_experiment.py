"""The tiny test model as an experiment file, for runs started as separate processes.

  python -m launch.local --num_processes=2 --devices_per_process=4 -- python -m engine.main \
      --config=tests/support/multihost_experiment.py:mesh=2x2x2,mode=manual,steps=4 --workdir=DIR
"""

from engine.config import apply_run_args, parse_run_arg
from tests.support.helpers import tiny_config


def get_config(arg=None):
  args = parse_run_arg(arg, steps=4, checkpoint_every=2, decay_steps=8, dcn_data=1)
  args.mesh = args.mesh or '2x2x2'
  config = apply_run_args(tiny_config(steps=args.steps), args)
  config.train.checkpoint_every = args.checkpoint_every
  config.mesh.dcn_data = args.dcn_data
  config.optim.decay_steps = args.decay_steps  # Independent of where a run stops, for resumes.
  return config
