"""Causal self-attention on heads that are already laid out.

  spec.py     AttentionSpec: one layer's attention as every path takes it (implementation, scale,
              soft cap, window), and how each path scales, caps and masks through it
  causal.py   over the whole sequence a device holds: the einsum path, jax.nn.dot_product_attention
              or the splash kernel
  splash.py   the Pallas TPU splash-attention kernel, whole and per ring block

Ring attention over a sequence split between devices is engine/parallel/context.py's; attention
through generation's key / value cache, engine/parallel/decode.py's.
"""
