"""What a registered model tells the engine: the interface every model plugs in through.

The train loop, the parameter table, the communication theory and the compare tool ask a model
only for what is here; none of them reads a parameter by name. A model module provides a
`build(model_config, vocab_size) -> ModelSpec` function and one line in engine/models/__init__.py.

The module that `ModelSpec.create` returns must:
  - be an `nnx.Module` whose call `model(tokens_BL, ops=LocalOps()) -> logits_BLV` maps int32
    tokens [batch, length] to logits [batch, length, vocab_size];
  - name every parameter's dimensions with Flax's own sharding metadata, logical names rather
    than mesh axes: `nnx.with_partitioning(init, ('embed', 'mlp'))` for a standard layer's
    initialiser, or `nnx.Param(value, out_sharding=('embed', 'mlp'))`. The engine's rules map
    the names (`vocab`, `embed`, `heads`, `head_dim`, `mlp`, `norm`, ...) to mesh axes; an
    unannotated parameter is replicated;
  - call `ops` where a layout may need to communicate (engine/models/ops.py): `embed_lookup` for
    the token embedding, `finish_contraction(y, name)` after a matmul that contracts a dimension
    the rules may split (Megatron's row-parallel layers), `column_parallel_input(x, name)` on an
    input that feeds several column-parallel matmuls, `constrain` on activations, and `layer`
    around the application of each layer stacked along the `LAYERS` axis;
  - optionally, define `logits_and_aux_loss(tokens_BL, ops) -> (logits_BLV, scalar)`: the
    scalar (e.g. a mixture of experts' load-balancing loss) is added to the training loss
    (`logits_and_aux_loss` below); and `logits_aux_loss_and_stats(tokens_BL, ops)`, the same
    and a dict of scalars / vectors for the train step's metrics (steps.model_metrics);
  - for a chunked loss (model.loss_chunks > 1, `separable_head=True`), split its call in two:
    `features(tokens_BL, ops) -> x_BLD` (or `features_aux_loss_and_stats`, as above with
    features in place of logits) and `head_logits(x_BLD, ops) -> logits_BLV` for any number of
    positions, so that the loss projects a slice of the positions at a time;
  - for context (sequence) parallelism (`context_parallel=True`), take positions from
    `ops.positions` and compute attention with `ops.attention`: a device then holds only part of
    each sequence. Packed documents (data.document_masking) need the same: `ops.positions` is
    then [batch, length], each token's position in its document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx

from engine.models.layers import group_layers


@dataclasses.dataclass(frozen=True)
class ExpertsSpec:
  """A mixture of experts in place of every layer's MLP (engine/models/moe/layer.py), as the
  communication theory and the planner need it."""
  num_experts: int
  experts_per_token: int
  capacity_factor: float  # Slots per expert and sequence: ceil(L * k / E * factor); 0: dropless.
  shared_expert: bool  # A dense shared expert beside the routed ones.
  # aux_free balancing: the router bias' step (engine/models/moe/balance.py); 0: none.
  bias_rate: float = 0.0


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A built model: how to create it, and the facts about it the engine's tools need."""
  name: str
  factory: Callable[[nnx.Rngs], nnx.Module]
  vocab_size: int
  embed_dim: int  # Width D of the activations [batch, length, D] that flow between layers.
  num_layers: int
  # Per layer, the logical dimension each row-parallel matmul contracts (each ends with
  # ops.finish_contraction on a [batch, length, embed_dim] activation); e.g. ('heads', 'mlp').
  row_parallel_per_layer: tuple[str, ...]
  # Training FLOPs (forward + backward) per token at a sequence length: 6 x the parameters that
  # multiply activations, plus attention's length-dependent matmuls.
  flops_per_token: Callable[[int], float]
  # Logical names the rules split only where every dimension so named divides over the mesh
  # axes, and replicate otherwise (e.g. 'kv_heads': grouped-query attention with fewer key /
  # value heads than the tensor axis). Any other name must divide, or the run is refused.
  split_where_divisible: tuple[str, ...] = ()
  # Whether the model reads positions and attends only through `ops`, so that a mesh may split
  # its sequences (mesh.context > 1).
  context_parallel: bool = False
  # Set by the engine, not the model (train.pipeline_repeats): the stacked layers' parameters
  # in this many consecutive groups, [groups, layers / groups, ...], for a circular pipeline.
  layer_groups: int = 1
  # The mixture of experts of every layer, or None for a dense model.
  experts: ExpertsSpec | None = None
  # The weights model.matmul_precision quantizes, all layers (0 unquantized; not the head, the
  # embedding, a router or a dropless dispatch's experts): engine.plan times their 6 FLOPs per
  # weight and token at the chip's int8 / fp8 peak.
  quantized_params: int = 0
  # Of num_layers, those that run before the stacked layers, outside them (a mixture of experts'
  # dense first layers): no experts, not split into pipeline stages, each contracting 'heads'
  # and 'mlp' row-parallel.
  first_layers: int = 0
  # Whether the module defines `features` (or `features_aux_loss_and_stats`) and `head_logits`
  # (above), which a chunked loss needs.
  separable_head: bool = False
  # Whether the token embedding, the parameter named ('vocab', 'embed'), is read only through
  # `ops.embed_lookup` and the head, ('embed', 'vocab'), only by `head_logits` (not tied): manual
  # FSDP then looks tokens up on each device's columns of the table, and a chunked loss splits
  # the head by vocabulary, rather than gathering either (engine/parallel/manual_ops.py).
  untied_embeddings: bool = False
  # Latent attention (DeepSeek): what generation caches per layer and position instead of keys
  # and values, (latent size, rotary key size); None: keys and values per key / value head.
  latent_cache: tuple[int, int] | None = None
  # Which parameters train, by path ('blocks/lora_q_a'); the others are frozen: no optimizer
  # state (engine/optimizer.py), their gradients dropped before the norm, so neither they nor
  # their reductions are computed (engine/parallel/steps.py). None: every parameter trains.
  trainable: Callable[[str], bool] | None = None
  # Parameters this model adds to a base model (adapters), by path: a base's checkpoint
  # (train.init_from: another run, Hugging Face) lacks them, so they keep their initial values
  # when it is loaded. None: a base holds every parameter.
  added: Callable[[str], bool] | None = None

  def create(self, rngs: nnx.Rngs) -> nnx.Module:
    """The model, unplaced. The engine places parameters itself (a jit with out_shardings from
    the rules), so Flax's eager sharding, which reads the names as mesh axes, is off."""
    with nnx.use_eager_sharding(False):
      return group_layers(self.factory(rngs), self.layer_groups)


  def trainable_mask(self, params):
    """True for each parameter of `params` (any pytree keyed like the parameters) that trains."""
    return jax.tree_util.tree_map_with_path(
        lambda keys, _: self.trainable is None or self.trainable(param_path(keys)), params)

  def base_params(self, params: dict) -> dict:
    """The nested parameter dict without the added parameters: what a base checkpoint holds."""
    return _filtered(params, lambda path: not (self.added and self.added(path)))

  def with_base(self, params: dict, base: dict) -> dict:
    """`params` with every parameter a base holds taken from `base` (base_params' structure)."""
    return _merged(params, base, lambda path: bool(self.added and self.added(path)))


def param_path(keys) -> str:
  """A parameter's path as the spec's predicates take it ('blocks/w_up_DF'), from tree keys."""
  return '/'.join(str(getattr(key, 'key', key)) for key in keys)


def _filtered(tree, keep: Callable[[str], bool], prefix: str = ''):
  if not isinstance(tree, dict):
    return tree
  return {k: _filtered(v, keep, f'{prefix}{k}/') for k, v in tree.items()
          if isinstance(v, dict) or keep(f'{prefix}{k}')}


def _merged(tree, base, own: Callable[[str], bool], prefix: str = ''):
  if not isinstance(tree, dict):
    return base
  return {k: v if not isinstance(v, dict) and own(f'{prefix}{k}') else
          _merged(v, base[k], own, f'{prefix}{k}/') for k, v in tree.items()}


def logits_and_aux_loss(model: nnx.Module, tokens_BL, ops=None):
  """(logits, auxiliary loss to add to the training loss): the model's own `logits_and_aux_loss`
  where it has one, else its logits and 0.0."""
  if hasattr(model, 'logits_and_aux_loss'):
    return model.logits_and_aux_loss(tokens_BL, *([ops] if ops is not None else []))
  return (model(tokens_BL) if ops is None else model(tokens_BL, ops)), 0.0


def logits_aux_loss_and_stats(model: nnx.Module, tokens_BL, ops=None):
  """(logits, auxiliary loss, a dict of statistics for the train step's metrics): the model's
  own `logits_aux_loss_and_stats` where it has one (a mixture of experts' router statistics),
  else `logits_and_aux_loss` and {}."""
  if hasattr(model, 'logits_aux_loss_and_stats'):
    return model.logits_aux_loss_and_stats(tokens_BL, *([ops] if ops is not None else []))
  return (*logits_and_aux_loss(model, tokens_BL, ops), {})


def features_aux_loss_and_stats(model: nnx.Module, tokens_BL, ops, with_aux: bool = True):
  """logits_aux_loss_and_stats with the normalised features before the head in place of the
  logits (a `separable_head` model); without `with_aux` (evaluation), (features, 0.0, {})."""
  if hasattr(model, 'features_aux_loss_and_stats'):
    return model.features_aux_loss_and_stats(tokens_BL, ops, with_aux)
  return model.features(tokens_BL, ops), 0.0, {}
