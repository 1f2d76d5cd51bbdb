"""A JAX / Flax NNX training engine whose parallel layouts run in auto (jit) or manual mode."""

from engine.runtime import allocator as _host
from engine.runtime import platforms as _platforms

# Before anything imports JAX and starts XLA's threads: the allocator settings only reach threads
# that have not allocated yet (engine/runtime/allocator.py says why they matter).
_host.tune_malloc()
# Before JAX reads JAX_PLATFORMS: 'cpu' on a CPU machine with libtpu installed (engine/runtime/platforms.py).
_platforms.select()
