"""The optimizer: AdamW on a warmup + cosine schedule, with global-norm clipping kept apart.

Clipping happens in the train step (`clip_by_global_norm`), not in the optax chain: in manual
mode the norm of sharded gradients needs collectives that only the step can write, and keeping it
out of the chain gives both modes the same optimizer state, so checkpoints move between them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Optimizer:
  tx: optax.GradientTransformation  # AdamW, without clipping.
  schedule: optax.Schedule  # Learning rate by optimizer step (0-based), the one tx uses.
  clip_norm: float  # Gradients are scaled down to this global norm before tx.


def learning_rate_schedule(optim_config, num_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to `end_learning_rate`.

  The decay ends at `decay_steps` (warmup included), by default the end of training; a run
  shorter than its warmup simply never leaves it."""
  decay_steps = optim_config.decay_steps if optim_config.decay_steps > 0 else num_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim_config.learning_rate,
      warmup_steps=optim_config.warmup_steps,
      decay_steps=max(decay_steps, optim_config.warmup_steps + 1),
      end_value=optim_config.end_learning_rate)


def make_optimizer(optim_config, num_steps: int) -> Optimizer:
  """AdamW; weight decay on matrices only (not norms or biases), or on every parameter."""
  schedule = learning_rate_schedule(optim_config, num_steps)
  if optim_config.weight_decay_on == 'all':
    decay_mask = None
  else:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.adamw(schedule, b1=optim_config.b1, b2=optim_config.b2,
                   weight_decay=optim_config.weight_decay, mask=decay_mask)
  return Optimizer(tx, schedule, optim_config.grad_clip_norm)


def clip_by_global_norm(grads, global_norm: jax.Array, max_norm: float):
  """Scales gradients down to `max_norm` when their global norm exceeds it (optax's formula)."""
  scale = jnp.where(global_norm < max_norm, 1.0, max_norm / global_norm)
  return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
