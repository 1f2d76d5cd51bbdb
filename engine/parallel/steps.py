"""What every step builder returns, and the pieces of a train step both modes share.

Shape suffixes: B batch, L length, L1 = L + 1 (a token window: inputs are its first L tokens,
targets its last L), V vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from engine.models.moe import balance as expert_balance
from engine.models import documents
from engine.models.documents import segments_and_positions
from engine.models.ops import LAYERS
from engine.models.chunked_loss import chunked_cross_entropy
from engine.models.spec import ModelSpec, features_aux_loss_and_stats, logits_aux_loss_and_stats
from engine.optimizer import clip_by_global_norm
from engine import sharding
from engine.sharding import logical_axes_of
from engine.state import TrainSetup


@dataclasses.dataclass(frozen=True)
class Steps:
  """Jitted (or jit-wrapped shard_map) functions on the sharded train state.

  train(state, tokens_BL1) -> (new state, {'loss', 'grad_norm', 'learning_rate'} and, for a
    mixture of experts, its router health: model_metrics); the state is donated. The loss is
    the one before the update, the gradient norm the one before clipping.
  eval(params, tokens_BL1) -> mean cross-entropy (without a model's auxiliary loss).
  gradients(params, tokens_BL1) -> (mean loss, gradients of the mean loss, sharded like params):
    what `train` computes before it clips and updates, for checking a layout against a
    reference.
  window_losses(params, tokens_BL1) -> (each window's summed cross-entropy [B] float32, the
    predictions it sums [B] int32): `eval`'s loss before its mean (engine.evaluate).
  """
  train: Callable
  eval: Callable
  gradients: Callable
  window_losses: Callable


# What a stacked layer keeps for the backward pass (config key model.remat): everything ('none':
# no rematerialisation), nothing ('full': the layer is recomputed), or matmul outputs only; the
# offload_ policy keeps the same outputs as its namesake in host memory (pinned_host), copied
# out in the forward pass and back in the backward pass (TPU, GPU: REMAT_OFFLOADS).
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots_saveable': jax.checkpoint_policies.dots_saveable,
    'dots_with_no_batch_dims_saveable':
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'offload_dots_with_no_batch_dims':
        jax.checkpoint_policies.offload_dot_with_no_batch_dims('device', 'pinned_host'),
}
# The policies that move saved values to host memory: XLA:CPU drops their memory kinds.
REMAT_OFFLOADS = ('offload_dots_with_no_batch_dims',)


def next_token_loss(params, graphdef: nnx.GraphDef, tokens_BL1: jax.Array, ops,
                    with_aux: bool = True, with_stats: bool = False,
                    eos_id: int | None = None, count=None, loss_chunks: int = 1):
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], plus (`with_aux`: the
  training loss, not evaluation's) the model's auxiliary loss (a mixture of experts' router
  losses; engine.models.spec). `with_stats`: (that loss, the model's statistics for the
  metrics: {} for a dense model).

  `eos_id` (data.document_masking): the rows pack documents ended by this id; attention stays
  within each, positions restart at each, and the predictions from an end-of-text token (whose
  target is the next document's) are skipped: the loss is their sum / `count` (kept_count's,
  by default this batch's).

  `loss_chunks` > 1 (a `separable_head` model): the head and cross-entropy run on that many
  slices of the positions in turn (engine/models/chunked_loss.py)."""
  if loss_chunks > 1:
    ops = ops.for_chunked_loss()
  model, ops, inputs_BL, targets_BL, keep_BL = _predictions(params, graphdef, tokens_BL1, ops,
                                                            eos_id)
  if eos_id is not None:
    count = kept_count(ops, tokens_BL1, eos_id) if count is None else count
  if loss_chunks > 1:
    features_BLD, aux_loss, stats = features_aux_loss_and_stats(model, inputs_BL, ops, with_aux)
    loss = chunked_cross_entropy(lambda x_BlD: model.head_logits(x_BlD, ops), features_BLD,
                                 targets_BL, keep_BL, count, ops, loss_chunks) + aux_loss
    return (loss, stats) if with_stats else loss
  if not with_aux:
    return ops.cross_entropy(model(inputs_BL, ops), targets_BL, keep_BL, count)
  logits_BLV, aux_loss, stats = logits_aux_loss_and_stats(model, inputs_BL, ops)
  loss = ops.cross_entropy(logits_BLV, targets_BL, keep_BL, count) + aux_loss
  return (loss, stats) if with_stats else loss


def window_losses(params, graphdef: nnx.GraphDef, tokens_BL1: jax.Array, ops,
                  eos_id: int | None = None):
  """Each window's summed cross-entropy over the predictions the loss keeps, and how many it
  sums ([B] each, over this device's positions): next_token_loss's evaluation loss (no
  auxiliary loss) before it divides, the layout's own cross-entropy applied row by row."""
  model, ops, inputs_BL, targets_BL, keep_BL = _predictions(params, graphdef, tokens_BL1, ops,
                                                            eos_id)
  if keep_BL is None:
    keep_BL = jnp.ones(targets_BL.shape, bool)

  def row_sum(logits_LV, targets_L, keep_L):  # The kept losses' sum / 1.
    return ops.cross_entropy(logits_LV[None], targets_L[None], keep_L[None], 1.0)

  summed_B = jax.vmap(row_sum)(model(inputs_BL, ops), targets_BL, keep_BL)
  return summed_B, keep_BL.sum(axis=-1, dtype=jnp.int32)


def _predictions(params, graphdef: nnx.GraphDef, tokens_BL1: jax.Array, ops,
                 eos_id: int | None):
  """(the model prepared by `ops`, ops with the packed documents, inputs [B, L], targets
  [B, L], which predictions the loss keeps [B, L] or None without documents): what both losses
  above start from."""
  model = ops.prepare_params(nnx.merge(graphdef, params))
  # Packed documents' tokens may carry flags (engine/models/documents.py): the model sees ids.
  inputs_BL, targets_BL = ops.inputs_and_targets(
      tokens_BL1 if eos_id is None else documents.token_ids(tokens_BL1))
  keep_BL = None
  if eos_id is not None:
    ops, keep_BL = packed_documents(ops, tokens_BL1, eos_id)
  return model, ops, inputs_BL, targets_BL, keep_BL


def packed_documents(ops, tokens_BL1: jax.Array, eos_id: int):
  """(ops with the documents of this device's tokens, which predictions the loss keeps [B, L]):
  derived from the whole windows and sliced as the layout slices the tokens, so no device needs
  another's tokens."""
  segments_BL1, positions_BL1 = segments_and_positions(tokens_BL1, eos_id)
  local = lambda x_BL1: ops.inputs_and_targets(x_BL1)[0]
  return (ops.with_documents(local(segments_BL1), local(positions_BL1)),
          local(kept_tokens(tokens_BL1, eos_id)))


def kept_tokens(tokens_BL1, eos_id: int | None):
  """Whether the loss keeps the prediction made from each token of the windows ([B, L1]; the
  last column predicts nothing): every one, or with packed documents all but those from a
  token that ends its document (whose target is the next document's) and those of a target
  flagged as context (a conversation's prompt: engine/models/documents.py). NumPy windows give
  a NumPy mask (engine.evaluate counts the bytes of the kept targets)."""
  if eos_id is None:
    return np.ones(tokens_BL1.shape, bool)
  xp = np if isinstance(tokens_BL1, np.ndarray) else jnp
  next_trained_BL1 = xp.concatenate(
      [documents.trained_targets(tokens_BL1[:, 1:]), xp.ones_like(tokens_BL1[:, :1], bool)],
      axis=1)
  return ~documents.document_ends(tokens_BL1, eos_id) & next_trained_BL1


def kept_count(ops, tokens_BL1: jax.Array, eos_id: int | None, microbatches: int = 1):
  """The predictions the loss keeps in the whole (global) batch, per device that averages the
  loss (ops.batch_mean) and per micro-batch: each micro-batch's loss is its sum over this, so
  the step's average of them is the global sum / the global count. None without documents."""
  if eos_id is None:
    return None
  keep_BL = ops.inputs_and_targets(kept_tokens(tokens_BL1, eos_id))[0]
  count = ops.batch_mean(keep_BL.sum(dtype=jnp.float32)) / microbatches
  return jnp.where(count > 0, count, 1.0)  # Nothing kept: a loss of 0, not 0 / 0.


def model_metrics(stats: dict) -> dict:
  """The train step's metrics of the model's statistics (next_token_loss's `with_stats`): a
  mixture of experts' router health (averaged over micro-batches).

  Each expert's load is its share of its layer's token-assignments as a multiple of the mean
  share (a perfectly balanced router: all 1.0). moe/load_min, moe/load_max: over every layer's
  experts; moe/load_cv: the coefficient of variation (standard deviation over the experts /
  mean) of each layer's load, averaged over layers; moe/dropped_fraction: assignments the
  capacity dropped; moe/balance_loss, moe/z_loss: the router losses before their coefficients
  (these three averaged over layers). aux_free balancing adds moe/bias_min and moe/bias_max
  (expert_balance.bias_metrics)."""
  if 'load' not in stats:
    return {}
  load_LE = stats['load'] * stats['load'].shape[-1]  # Each layer's mean is 1.
  return {'moe/balance_loss': stats['balance'], 'moe/z_loss': stats['z'],
          'moe/dropped_fraction': stats['dropped'], 'moe/load_min': load_LE.min(),
          'moe/load_max': load_LE.max(),
          'moe/load_cv': (load_LE.std(-1) / load_LE.mean(-1)).mean()}


def split_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
  """[B, ...] -> [k, B / k, ...] (k = microbatches): micro-batch i holds rows i, i + k, i + 2k,
  ..., so every device holds an equal share of each when the rows are split over devices."""
  return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def accumulate_gradients(value_and_grad, params, tokens_BL1: jax.Array, microbatches: int,
                         constrain=lambda micro_KBL1: micro_KBL1):
  """Mean loss and gradients over `microbatches` slices of the batch, summed in a scan: every
  leaf of what `value_and_grad` returns is averaged (a loss's statistics too, with has_aux).

  Micro-batch i holds rows i, i + k, i + 2k, ... of the batch (k = microbatches), so every
  device holds an equal share of each when the batch rows are split over devices; `constrain`
  lays the [k, B / k, L1] stack out accordingly in auto mode."""
  if microbatches == 1:
    return value_and_grad(params, tokens_BL1)
  micro_KBL1 = constrain(split_microbatches(tokens_BL1, microbatches))
  # The traced call only gives the sums their types (varying mesh axes included, in manual
  # mode); nothing uses its values, so XLA drops it as dead code.
  zeros = jax.tree.map(jnp.zeros_like, value_and_grad(params, micro_KBL1[0]))

  def add(total, micro_BL1):
    return jax.tree.map(jnp.add, total, value_and_grad(params, micro_BL1)), None

  total, _ = jax.lax.scan(add, zeros, micro_KBL1)
  return jax.tree.map(lambda x: x / microbatches, total)


def optimizer_on_device(setup: TrainSetup, train_step: Callable) -> Callable:
  """`train_step(state, batch)`, with the optimizer state moved from host memory to the devices
  at its start and back at its end under parallelism.offload_optimizer (the state's shardings
  keep it in host memory between steps); `train_step` itself otherwise."""
  if not setup.options.offload_optimizer:
    return train_step
  on_device = sharding.named(setup.mesh, setup.state_specs()['opt_state'])
  on_host = setup.state_shardings()['opt_state']

  def step(state, tokens_BL1):
    state = {**state, 'opt_state': jax.device_put(state['opt_state'], on_device)}
    state, metrics = train_step(state, tokens_BL1)
    return {**state, 'opt_state': jax.device_put(state['opt_state'], on_host)}, metrics

  return step


def trainable_only(model: ModelSpec, grads):
  """`grads` with every frozen parameter's gradient (ModelSpec.trainable) replaced by zeros: the
  frozen parameters' weight gradients, and their reductions, are then dead code. Called before
  the global norm, which the frozen ones must not count."""
  if model.trainable is None:
    return grads
  return jax.tree.map(lambda g, trains: g if trains else jnp.zeros_like(g), grads,
                      model.trainable_mask(grads))


def apply_update(setup: TrainSetup, state, loss, grads, grad_norm, stats=None,
                 bias_layout=expert_balance.WholeBias(), tx=None):
  """The end of every train step: clip to the global norm, apply the optimizer, move a mixture
  of experts' router bias (aux_free balancing), count the step.

  `grads` are the mean-loss gradients laid out like the parameters and `grad_norm` their global
  norm, however the mode computed them; `stats` the model's statistics (model_metrics);
  `bias_layout` how this step holds the router biases (manual mode: a block on each device);
  `tx` the optimizer's transformation for parameters in blocks (manual mode's Muon:
  Optimizer.blockwise), by default the optimizer's own."""
  optimizer = setup.optimizer
  grads = clip_by_global_norm(grads, grad_norm, optimizer.clip_norm)
  updates, opt_state = (tx or optimizer.tx).update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  experts, bias_metrics = setup.model.experts, {}
  if experts is not None and experts.bias_rate and stats:
    params = expert_balance.with_balanced_bias(params, state['params'], stats['load'],
                                               experts.bias_rate, bias_layout)
    bias_metrics = expert_balance.bias_metrics(state['params'], bias_layout)
  if setup.options.skip_nonfinite:  # Loss and norm are global: every device agrees.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    params, opt_state = keep(params, state['params']), keep(opt_state, state['opt_state'])
  metrics = {'loss': loss, 'grad_norm': grad_norm,
             'learning_rate': optimizer.schedule(state['step']), **model_metrics(stats or {}),
             **bias_metrics}
  return {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state}, metrics


def map_params(module: nnx.Module, fn: Callable, skip_stacked: bool = False) -> nnx.Module:
  """A copy of `module` whose parameter values are `fn(value, logical_axes)`.

  With `skip_stacked`, parameters stacked along the LAYERS axis are left alone: those are
  prepared one layer at a time, inside ops.layer."""
  return map_params_together(
      module, lambda values, axes: [fn(v, a) for v, a in zip(values, axes)], skip_stacked)


def map_params_together(module: nnx.Module, fn: Callable,
                        skip_stacked: bool = False) -> nnx.Module:
  """`map_params` with one call `fn(values, logical axes of each) -> new values` for all the
  parameters it maps, which it can then treat together (manual FSDP gathers them in one
  collective)."""
  graphdef, state = nnx.split(module)
  variables, treedef = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  mapped = [i for i, v in enumerate(variables) if isinstance(v, nnx.Param)
            and not (skip_stacked and LAYERS in logical_axes_of(v))]
  values = fn([variables[i][...] for i in mapped], [logical_axes_of(variables[i]) for i in mapped])
  for i, value in zip(mapped, values):
    variables[i] = variables[i].replace(value)
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, variables))
