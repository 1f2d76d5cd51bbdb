"""Tiny GPT on the embedded corpus (the Python standard library's sources): the default job.

  python -m engine.main --config=experiments/tiny.py --workdir=/tmp/tiny

Hardware: 1 CPU device (2 cores), about 45 seconds (18 steps/s). Byte-level, 4 layers, width 64,
context 64, batch 16, 600 steps. Expect the train loss to fall from ln(256) = 5.5 to about 2.2
and the eval loss to reach about 2.31 (measured: 2.309 at step 600).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]] (axes not given are 1;
e.g. mesh=2x2x2 on 8 devices), steps=N. Any key can be overridden: --config.train.num_steps=50.
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  config = default_config()
  config.model.num_layers = 4
  config.train.eval_every = 200
  config.train.checkpoint_every = 200
  config.train.log_every = 50
  return apply_run_args(config, parse_run_arg(arg, steps=600))
