"""The optimizer: AdamW (or Muon on the matrices: engine/muon.py) on a learning-rate schedule,
with global-norm clipping kept apart.

Schedules (optim.schedule), all with a linear warmup from 0 to optim.learning_rate:
  cosine: cosine decay to optim.end_learning_rate, ending at optim.decay_steps (-1: the end of
    training);
  constant: the peak from the end of warmup on;
  wsd (warmup-stable-decay): the peak, then a linear decay to optim.end_learning_rate over the
    last optim.decay_fraction of the steps up to optim.decay_steps (-1: the end of training).
Every schedule is a function of the optimizer step only, so the optimizer state (Adam moments
and a step count) has the same structure under each and checkpoints resume under any.

Clipping happens in the train step (`clip_by_global_norm`), not in the optax chain: in manual
mode the norm of sharded gradients needs collectives that only the step can write, and keeping it
out of the chain gives both modes the same optimizer state, so checkpoints move between them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonState

from engine import muon as muon_lib


@dataclasses.dataclass(frozen=True)
class Optimizer:
  # AdamW or Muon, without clipping; Muon's is set once the parameters are known
  # (for_parameters).
  tx: optax.GradientTransformation | None
  schedule: optax.Schedule  # Learning rate by optimizer step (0-based), the one tx uses.
  clip_norm: float  # Gradients are scaled down to this global norm before tx.
  # Muon: tx from the parameters' dimension numbers and, in manual mode, a wrapper that runs
  # its orthogonalization on whole matrices (engine/muon.py: muon); None for AdamW, whose
  # update is elementwise.
  build: Callable | None = None
  matrix_dims: Any = None  # Muon: each parameter's dimension numbers (None: AdamW's), by path.

  def for_parameters(self, state) -> Optimizer:
    """This optimizer for the parameters of a model state (nnx Variables, abstract or not):
    Muon learns which are matrices from their logical axes."""
    if self.build is None:
      return self
    dims = muon_lib.parameter_dims(state)
    return dataclasses.replace(self, tx=self.build(dims, None), matrix_dims=dims)

  def blockwise(self, whole: Callable) -> optax.GradientTransformation:
    """tx for parameters held in blocks (manual mode): `whole(transformation)` runs Muon's
    orthogonalization on whole matrices; AdamW needs no change."""
    return self.tx if self.build is None else self.build(self.matrix_dims, whole)


SCHEDULES = ('cosine', 'constant', 'wsd')
NAMES = ('adamw', 'muon')


def schedule_end(optim_config, num_steps: int) -> int | None:
  """The step at which the schedule reaches its end value: `decay_steps`, by default the end of
  training, but at least one step past the warmup; None for `constant`, which has no end."""
  if optim_config.schedule == 'constant':
    return None
  end = optim_config.decay_steps if optim_config.decay_steps > 0 else num_steps
  return max(end, optim_config.warmup_steps + 1)  # One step of decay at least.


def learning_rate_schedule(optim_config, num_steps: int) -> optax.Schedule:
  """The learning rate by optimizer step (0-based) of `optim_config.schedule`.

  A run shorter than its warmup simply never leaves it; after its end a schedule stays at
  `end_learning_rate`."""
  peak, warmup = optim_config.learning_rate, optim_config.warmup_steps
  end = schedule_end(optim_config, num_steps)
  if optim_config.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=end,
        end_value=optim_config.end_learning_rate)
  warmup_schedule = optax.linear_schedule(0.0, peak, warmup)
  if optim_config.schedule == 'constant':
    return optax.join_schedules([warmup_schedule, optax.constant_schedule(peak)], [warmup])
  # wsd: the decay takes the last decay_fraction of the steps (at least one), but never the
  # warmup's: a run too short for both shortens its decay.
  decay_start = max(warmup, end - max(1, round(optim_config.decay_fraction * end)))
  decay = optax.linear_schedule(peak, optim_config.end_learning_rate, end - decay_start)
  return optax.join_schedules([warmup_schedule, optax.constant_schedule(peak), decay],
                              [warmup, decay_start])


def make_optimizer(optim_config, num_steps: int,
                   trainable: Callable[[Any], Any] | None = None) -> Optimizer:
  """AdamW; weight decay on matrices only (not norms or biases), or on every parameter; the
  moments stored in optim.mu_dtype and optim.nu_dtype (stored_moments). With optim.name=muon,
  Muon on the matrices Muon takes and this AdamW on the rest, built once the parameters are
  known (Optimizer.for_parameters). `trainable` (params -> a bool per parameter: the model's
  ModelSpec.trainable_mask, where only some train): AdamW on those, every other parameter frozen,
  without optimizer state."""
  schedule = learning_rate_schedule(optim_config, num_steps)
  tx = adamw(optim_config, schedule)
  stored = jnp.dtype(optim_config.mu_dtype), jnp.dtype(optim_config.nu_dtype)
  if trainable is not None:
    # The labels key the optimizer state in checkpoints: the first runs to freeze parameters
    # (LoRA's) named the trained ones 'adapters', and their workdirs still resume.
    labels = lambda params: jax.tree.map(lambda t: 'adapters' if t else 'frozen',
                                         trainable(params))
    tx = optax.multi_transform({'adapters': stored_moments(tx, *stored),
                                'frozen': optax.set_to_zero()}, labels)
    return Optimizer(tx, schedule, optim_config.grad_clip_norm)
  if optim_config.name == 'adamw':
    return Optimizer(stored_moments(tx, *stored), schedule, optim_config.grad_clip_norm)
  build = lambda dims, whole: stored_moments(
      muon_lib.muon(optim_config, schedule, tx, dims, whole), *stored)
  return Optimizer(None, schedule, optim_config.grad_clip_norm, build)


def adamw(optim_config, schedule: optax.Schedule) -> optax.GradientTransformation:
  """optax's AdamW with the optim keys, moments in float32: what optim.name=adamw runs and Muon
  leaves its other parameters to."""
  if optim_config.weight_decay_on == 'all':
    decay_mask = None
  else:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.adamw(schedule, b1=optim_config.b1, b2=optim_config.b2,
                     weight_decay=optim_config.weight_decay, mask=decay_mask)


def stored_moments(tx: optax.GradientTransformation, mu_dtype,
                   nu_dtype=jnp.float32) -> optax.GradientTransformation:
  """`tx` whose Adam moments are kept in `mu_dtype` and `nu_dtype` between steps and computed in
  float32: each step widens them, updates them as float32 and rounds the new moments to store
  them; the step's update uses the unrounded ones. (optax's own mu_dtype decays the stored moment
  in its dtype: in bfloat16, b1 = 0.9 itself rounds to 0.8984, and the moment's weights no
  longer sum to one.)"""
  if mu_dtype == nu_dtype == jnp.float32:
    return tx

  def init(params):
    return _with_moment_dtypes(tx.init(params), mu_dtype, nu_dtype)

  def update(updates, state, params=None):
    widened = _with_moment_dtypes(state, jnp.float32, jnp.float32)
    updates, state = tx.update(updates, widened, params)
    return updates, _with_moment_dtypes(state, mu_dtype, nu_dtype)

  return optax.GradientTransformation(init, update)


def _with_moment_dtypes(state, mu_dtype, nu_dtype):
  """The optimizer state with every Adam first moment (and Muon's momentum) cast to `mu_dtype`,
  every second moment to `nu_dtype`."""
  cast = lambda tree, dtype: jax.tree.map(lambda m: m.astype(dtype), tree)

  def with_dtypes(node):
    if isinstance(node, optax.ScaleByAdamState):
      return node._replace(mu=cast(node.mu, mu_dtype), nu=cast(node.nu, nu_dtype))
    if isinstance(node, MuonState):
      return node._replace(mu=cast(node.mu, mu_dtype))
    return node

  return jax.tree.map(with_dtypes, state,
                      is_leaf=lambda node: isinstance(node, (optax.ScaleByAdamState, MuonState)))


def clip_by_global_norm(grads, global_norm: jax.Array, max_norm: float):
  """Scales gradients down to `max_norm` when their global norm exceeds it (optax's formula)."""
  scale = jnp.where(global_norm < max_norm, 1.0, max_norm / global_norm)
  return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
