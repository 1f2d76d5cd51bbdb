"""A JAX / Flax NNX training engine whose parallel layouts run in auto (jit) or manual mode."""

from engine import host as _host

# Before anything imports JAX and starts XLA's threads: the allocator settings only reach threads
# that have not allocated yet (engine/host.py says why they matter).
_host.tune_malloc()
