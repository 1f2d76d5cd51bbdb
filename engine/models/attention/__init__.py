"""Causal self-attention on heads that are already laid out.

  causal.py   over the whole sequence a device holds: the einsum path, jax.nn.dot_product_attention
              or the splash kernel; the scaling and soft cap every attention path shares
  splash.py   the Pallas TPU splash-attention kernel, whole and per ring block

Ring attention over a sequence split between devices is engine/parallel/context.py's; attention
through generation's key / value cache, engine/parallel/decode.py's.
"""
