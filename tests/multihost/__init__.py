"""Runs of several local processes (jax.distributed through launch/local.py)."""
