"""Tiny GPT on the embedded corpus (the Python standard library's sources): the default job.

  python -m engine.main --config=experiments/tiny.py --workdir=/tmp/tiny

Hardware: 1 CPU device (2 cores), about 45 seconds (18 steps/s). Byte-level, 4 layers, width 64,
context 64, batch 16, 600 steps. Expect the train loss to fall from ln(256) = 5.5 to about 2.2
and the eval loss to reach about 2.31 (measured: 2.309 at step 600).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT (e.g. mesh=2x2x2 on 8 devices),
steps=N. Any key can be overridden: --config.train.num_steps=50.
"""

from engine.config import default_config, parse_arg, set_mesh_shape


def get_config(arg=None):
  args = parse_arg(arg, mode='auto', mesh='', steps=600)
  config = default_config()
  config.model.num_layers = 4
  config.train.eval_every = 200
  config.train.checkpoint_every = 200
  config.train.log_every = 50
  config.parallelism.mode = args.mode
  if args.mesh:
    set_mesh_shape(config, args.mesh)
  config.train.num_steps = args.steps
  return config
