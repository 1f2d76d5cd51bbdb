"""The single-device reference: the plain computation every parallel mode must reproduce.

No mesh, no shardings, no ops layer: the model applied to the whole global batch on one device,
optax's own global-norm clipping chained before the same AdamW. Parity tests and the compare
report measure each mode against it, so it shares nothing with engine.parallel. It needs the
whole model and batch to fit on one device.

Shape suffixes as in engine/parallel/steps.py: `tokens_BL1` is a batch of windows of L + 1 tokens
(inputs the first L, targets the last L).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from engine import muon
from engine.models.moe import balance as expert_balance
from engine.models.spec import ModelSpec, logits_aux_loss_and_stats
from engine.optimizer import adamw, learning_rate_schedule, make_optimizer


class ReferenceRun:
  """Initialises the model like the engine (same key) and applies one step per call."""

  def __init__(self, model: ModelSpec, optim_config, num_steps: int, seed: int, device=None):
    self.device = device or jax.devices()[0]
    self.bias_rate = model.experts.bias_rate if model.experts else 0.0
    with jax.default_device(self.device):
      self.graphdef, params = nnx.split(model.create(nnx.Rngs(params=jax.random.key(seed))))
      self.params = nnx.to_pure_dict(params)
      self.tx = optax.chain(optax.clip_by_global_norm(optim_config.grad_clip_norm),
                            reference_optimizer(optim_config, num_steps, params))
      self.opt_state = self.tx.init(self.params)
    self._step = jax.jit(self._train_step)
    self._gradients = jax.jit(jax.value_and_grad(self._loss))

  def _loss(self, params, tokens_BL1):
    return self._loss_and_stats(params, tokens_BL1)[0]

  def _loss_and_stats(self, params, tokens_BL1):
    logits_BLV, aux_loss, stats = logits_aux_loss_and_stats(nnx.merge(self.graphdef, params),
                                                            tokens_BL1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BLV.astype('float32'), tokens_BL1[:, 1:]).mean() + aux_loss, stats

  def gradients(self, tokens_BL1):
    """(loss, gradients) of the current parameters on a host batch, without stepping."""
    return self._gradients(self.params, jax.device_put(tokens_BL1, self.device))

  def _train_step(self, params, opt_state, tokens_BL1):
    (loss, stats), grads = jax.value_and_grad(self._loss_and_stats, has_aux=True)(params,
                                                                                 tokens_BL1)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    metrics = {'loss': loss, 'grad_norm': optax.tree.norm(grads)}
    new_params = optax.apply_updates(params, updates)
    if self.bias_rate:  # aux_free: each layer's router bias moves by this whole batch's load.
      new_params = expert_balance.with_balanced_bias(new_params, params, stats['load'],
                                                     self.bias_rate)
    return new_params, opt_state, metrics, grads

  def step(self, tokens_BL1) -> dict[str, float]:
    """One optimizer step on a host batch; returns the loss (before the update) and the
    gradient's global norm (before clipping), and keeps the step's gradients in
    `last_gradients`."""
    self.params, self.opt_state, metrics, self.last_gradients = self._step(
        self.params, self.opt_state, jax.device_put(tokens_BL1, self.device))
    return {k: float(v) for k, v in metrics.items()}


def reference_optimizer(optim_config, num_steps: int, params: nnx.State):
  """The engine's AdamW; for optim.name=muon, optax's own `muon` (optax.contrib) on the matrices
  engine.muon.dimension_numbers names and that AdamW on the rest, in optax's partition."""
  if optim_config.name != 'muon':
    return make_optimizer(optim_config, num_steps).tx
  schedule = learning_rate_schedule(optim_config, num_steps)
  ratio = optim_config.muon_learning_rate / optim_config.learning_rate
  labels, matrix_dims = muon.partitioned(muon.parameter_dims(params))
  matrices = optax.contrib.muon(
      lambda step: schedule(step) * ratio, beta=optim_config.muon_beta,
      ns_steps=optim_config.muon_ns_steps, weight_decay=optim_config.weight_decay,
      muon_weight_dimension_numbers=matrix_dims)
  return optax.partition({'muon': matrices, 'adam': adamw(optim_config, schedule)}, labels)
