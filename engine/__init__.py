"""A JAX / Flax NNX training engine whose parallel layouts run in auto (jit) or manual mode.

On import: the runtime's allocator settings and choice of platform (below). The top level holds
what every command shares; each package's docstring maps its own modules.

  main.py       `python -m engine.main`: flags, jax.distributed, then the training loop
  assemble.py   the one run path: config -> validated, laid-out Run
  config.py     the schema and its defaults, experiment arguments, mesh strings (parse_mesh)
  mesh.py       the named device mesh (data, fsdp, tensor, context, stage, expert)
  sharding.py   rule presets (logical -> mesh axes), specs, sharded initialisation
  state.py      TrainSetup: the model and optimizer laid out on the mesh; the state's shapes
  optimizer.py  AdamW on a warmup + cosine / constant / wsd schedule; clipping
  muon.py       Muon on the matrices its logical axes name, AdamW on the rest
  chips.py      published peak FLOP/s, memory and bandwidths of TPUs and GPUs
  errors.py     ConfigError: bad input, reported as one `error:` line
"""

from engine.runtime import allocator as _host
from engine.runtime import platforms as _platforms

# Before anything imports JAX and starts XLA's threads: the allocator settings only reach threads
# that have not allocated yet (engine/runtime/allocator.py says why they matter).
_host.tune_malloc()
# Before JAX reads JAX_PLATFORMS: 'cpu' on a CPU machine with libtpu installed
# (engine/runtime/platforms.py).
_platforms.select()
