"""Pipeline parallelism: the stacked layers split into `stage` groups, micro-batches flowing
between them, in either mode.

  gpipe.py         GPipe and circular schedules (JAX differentiates the forward loop); the
                   schedule names, the bubble each implies, the stacked layers split by stage
  one_f_one_b.py   1F1B and interleaved 1F1B (and zero-bubble), which take each stage's
                   gradients themselves with jax.vjp
  zero_bubble.py   zero-bubble's backward pass, split into an input and a weight pass
  model_cut.py     a model cut at its layer stack (embedding, stages, head) for those schedules
  stage_lanes.py   how each mode holds one value per stage, for those schedules
  carry_trees.py   the pytree operations those schedules apply to a stack's carry
"""
