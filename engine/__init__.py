"""A JAX / Flax NNX training engine whose parallel layouts run in auto (jit) or manual mode."""

from engine import host as _host
from engine import platforms as _platforms

# Before anything imports JAX and starts XLA's threads: the allocator settings only reach threads
# that have not allocated yet (engine/host.py says why they matter).
_host.tune_malloc()
# Before JAX reads JAX_PLATFORMS: 'cpu' on a CPU machine with libtpu installed (engine/platforms.py).
_platforms.select()
