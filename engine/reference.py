"""The single-device reference: the plain computation every parallel mode must reproduce.

No mesh, no shardings, no ops layer: the model applied to the whole global batch on one device,
optax's own global-norm clipping chained before the same AdamW. Parity tests and the compare
report measure each mode against it, so it shares nothing with engine.parallel. It needs the
whole model and batch to fit on one device.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from engine import state as state_lib


class ReferenceRun:
  """Initialises the model like the engine (same key) and applies one step per call."""

  def __init__(self, model_factory, optim_config, num_steps: int, seed: int, device=None):
    self.device = device or jax.devices()[0]
    with jax.default_device(self.device):
      model = model_factory(nnx.Rngs(params=jax.random.key(seed)))
      self.graphdef, params = nnx.split(model)
      self.params = nnx.to_pure_dict(params)
      self.tx = optax.chain(optax.clip_by_global_norm(optim_config.grad_clip_norm),
                            state_lib.make_optimizer(optim_config, num_steps))
      self.opt_state = self.tx.init(self.params)
    self._step = jax.jit(self._train_step)

  def _train_step(self, params, opt_state, tokens_BL1):
    def loss_fn(params):
      logits_BLV = nnx.merge(self.graphdef, params)(tokens_BL1[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits_BLV.astype('float32'), tokens_BL1[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    metrics = {'loss': loss, 'grad_norm': optax.tree.norm(grads)}
    return optax.apply_updates(params, updates), opt_state, metrics

  def step(self, tokens_BL1) -> dict[str, float]:
    """One optimizer step on a host batch; returns the loss (before the update) and the
    gradient's global norm (before clipping)."""
    self.params, self.opt_state, metrics = self._step(
        self.params, self.opt_state, jax.device_put(tokens_BL1, self.device))
    return {k: float(v) for k, v in metrics.items()}
