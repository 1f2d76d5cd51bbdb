"""A JAX / Flax NNX training engine whose parallel layouts run in auto (jit) or manual mode."""
