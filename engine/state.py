"""The train state on the mesh: what it holds, where each part lives, and its sharded creation.

The state is a plain pytree `{'step', 'params', 'opt_state'}` with params as a nested dict of
arrays, so Orbax saves and restores it and both parallel modes share it unchanged. The model's
graph definition (structure + logical-axis metadata) stays outside, in `TrainSetup`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from engine import sharding
from engine.models.spec import ModelSpec
from engine.optimizer import Optimizer
from engine.sharding import Rules


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
  path: str  # '/'-joined, e.g. 'blocks/w_up_DF'.
  shape: tuple[int, ...]
  logical_axes: tuple[str | None, ...]
  spec: P
  shard_shape: tuple[int, ...]
  bytes_per_device: int
  moment_spec: P | None = None  # Its optimizer moments' layout (TrainSetup.moment_specs).


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """How a train step computes, in either mode (config keys in brackets)."""
  # Parameters and optimizer state stay float32; the forward and backward passes run in this
  # dtype [model.dtype]; logits and the loss are float32.
  compute_dtype: str = 'float32'
  # What each stacked layer keeps for the backward pass (engine.parallel.steps.REMAT_POLICIES)
  # [model.remat]; manual FSDP never keeps gathered weights, whatever the policy.
  remat: str = 'none'
  # Gradients are accumulated over this many slices of the batch, then synchronised and
  # applied once [train.microbatches].
  microbatches: int = 1
  # With pipeline stages: 'gpipe', 'circular' (engine/parallel/pipeline/gpipe.py), '1f1b',
  # 'interleaved_1f1b' or 'zb_h1' (engine/parallel/pipeline/one_f_one_b.py)
  # [train.pipeline_schedule, train.pipeline_repeats].
  pipeline_schedule: str = 'gpipe'
  # 1F1B: the head split over the stages by rows, or on the last stage [train.pipeline_head].
  pipeline_head: str = 'split'
  # Manual mode: the dtype of gradient reductions (and of the FSDP gathers whose transposes
  # they are) [parallelism.grad_reduce_dtype].
  grad_reduce_dtype: str = 'float32'
  # Manual FSDP: the gathered weights sent as int8 or fp8 with their scales, or ('default') in
  # grad_reduce_dtype [parallelism.gather_dtype] (engine/parallel/quantized_gather.py).
  gather_dtype: str = 'default'
  # Manual FSDP: a layer's split weights gathered in one all_gather, their gradients
  # reduce-scattered in one (engine/parallel/flat_gather.py), rather than one collective per
  # weight [parallelism.fsdp_gather; auto: on CPU devices].
  flat_gather: bool = False
  # A step whose loss or gradient norm is not finite leaves parameters and optimizer state as
  # they were (the loop counts it) [train.skip_nonfinite_steps > 0].
  skip_nonfinite: bool = False
  # Adam's moments laid out as their parameters ('params'), or also split over the batch axes
  # their parameter is replicated on ('zero1': ZeRO-1) [parallelism.optimizer_sharding].
  optimizer_sharding: str = 'params'
  # The optimizer state kept in host memory between steps, moved to the devices for the update
  # (engine.parallel.steps.optimizer_on_device) [parallelism.offload_optimizer: TPU, GPU].
  offload_optimizer: bool = False
  # The training and evaluation loss project this many slices of the positions in turn, so the
  # whole batch's float32 logits never exist (engine/models/chunked_loss.py) [model.loss_chunks].
  loss_chunks: int = 1
  # Packed documents: the tokenizer's end-of-text id, which ends each document of a window;
  # attention stays within documents, positions restart at each, and the loss skips the
  # predictions across a boundary [data.document_masking]. None: a window is one sequence.
  eos_id: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainSetup:
  """A model and its optimizer laid out on a mesh by rules: everything a step builder needs,
  derived without allocating anything."""
  model: ModelSpec
  graphdef: nnx.GraphDef
  abstract_params: Any  # nested dict of ShapeDtypeStruct
  param_specs: Any  # nested dict of PartitionSpec, same structure
  optimizer: Optimizer
  mesh: jax.sharding.Mesh
  rules: Rules
  options: StepOptions = StepOptions()

  def parameters(self) -> list[ParameterInfo]:
    """Every parameter with its logical axes, PartitionSpec and per-device size, by path."""
    graph_state = nnx.state(nnx.merge(self.graphdef, self.abstract_params))
    infos = []
    for path, variable in nnx.to_flat_state(graph_state):
      value = variable.get_value()
      axes = sharding.logical_axes_of(variable)
      spec = self.rules.spec(axes)
      shard = NamedSharding(self.mesh, spec).shard_shape(value.shape)
      infos.append(ParameterInfo('/'.join(map(str, path)), tuple(value.shape), axes, spec,
                                 tuple(shard), math.prod(shard) * value.dtype.itemsize,
                                 self._moment_spec(spec, value.shape)))
    return infos

  def attention_heads(self) -> dict[str, int]:
    """The model's query heads and key / value heads (equal without grouped-query attention),
    from its parameters' logical axes; {} for a model that names no heads."""
    sizes = {name: p.shape[p.logical_axes.index(name)] for p in self.parameters()
             for name in ('heads', 'kv_heads') if name in p.logical_axes}
    if 'heads' not in sizes:
      return {}
    return {'query': sizes['heads'], 'kv': sizes.get('kv_heads', sizes['heads'])}

  def state_specs(self):
    """PartitionSpecs of the whole train state; optimizer moments follow their parameters
    (moment_specs)."""
    abstract_opt = jax.eval_shape(self.optimizer.tx.init, self.abstract_params)
    # A partitioned optimizer's (Muon's) state masks the parameters the other part updates.
    masked = lambda x: isinstance(x, optax.MaskedNode)
    # The init on placeholders traced, not run: run, it would compile its counters' zeros, and
    # bad input found after the layout (a damaged train.init_from) must come before any compile.
    opt_specs = optax.tree_map_params(
        lambda placeholder: jax.eval_shape(self.optimizer.tx.init, placeholder),
        lambda leaf, spec: leaf if masked(leaf) else spec, abstract_opt,
        self.moment_specs(), transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P) or masked(x))
    return {'step': P(), 'params': self.param_specs, 'opt_state': opt_specs}

  def moment_specs(self):
    """The layout of each parameter's optimizer moments: the parameter's, or under ZeRO-1 split
    over the batch axes the parameter is replicated on as well (sharding.split_further)."""
    if self.options.optimizer_sharding != 'zero1':
      return self.param_specs
    return jax.tree.map(lambda spec, abstract: self._moment_spec(spec, abstract.shape),
                        self.param_specs, self.abstract_params)

  def _moment_spec(self, spec: P, shape) -> P:
    if self.options.optimizer_sharding != 'zero1':
      return spec
    return sharding.split_further(spec, tuple(shape), self.rules.mesh_axes('batch', activation=True),
                                  dict(self.mesh.shape))

  def state_shardings(self):
    """NamedShardings of the whole train state: the optimizer state's in host memory under
    options.offload_optimizer."""
    shardings = sharding.named(self.mesh, self.state_specs())
    if self.options.offload_optimizer:
      shardings['opt_state'] = jax.tree.map(lambda s: s.with_memory_kind('pinned_host'),
                                            shardings['opt_state'])
    return shardings

  def abstract_state(self):
    """ShapeDtypeStructs carrying their target shardings: the restore target for Orbax."""
    shapes = jax.eval_shape(lambda: self._fresh_state(jax.random.key(0)))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings())

  def batch_sharding(self) -> NamedSharding:
    """Token batches [batch, length + 1] are split over the batch axes of the rules."""
    return NamedSharding(self.mesh, self.rules.spec(('batch', None), activation=True))

  def abstract_batch(self, global_batch: int, seq_len: int) -> jax.ShapeDtypeStruct:
    """The token batch a step is compiled for: [global_batch, seq_len + 1] int32, sharded."""
    return jax.ShapeDtypeStruct((global_batch, seq_len + 1), np.int32,
                                sharding=self.batch_sharding())

  def _fresh_state(self, key):
    model = self.model.create(nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {'step': jnp.zeros((), jnp.int32), 'params': params,
            'opt_state': self.optimizer.tx.init(params)}

  def init(self, seed: int):
    """Creates the state already sharded; returns (state, compiled init) for its memory stats."""
    return sharding.sharded_init(
        lambda: self._fresh_state(jax.random.key(seed)),
        self.state_shardings())


def make_setup(model: ModelSpec, optimizer: Optimizer, mesh: jax.sharding.Mesh, rules: Rules,
               options: StepOptions = StepOptions()) -> TrainSetup:
  """Lays the model out by the rules (replicating the model's optional splits that the mesh
  does not divide)."""
  graphdef, abstract = sharding.abstract_model(model.create)
  mesh_shape = dict(mesh.shape)
  for name in model.split_where_divisible:
    ways = math.prod(mesh_shape[a] for a in rules.mesh_axes(name))
    sizes = [size for variable in jax.tree.leaves(abstract, is_leaf=sharding.is_variable)
             for size, axis in zip(variable.get_value().shape, sharding.logical_axes_of(variable))
             if axis == name]
    if any(size % ways for size in sizes):
      logging.info('%r dimensions %s do not split %d ways: replicated.', name, sizes, ways)
      rules = rules.replicating(name)
  specs = sharding.variable_specs(abstract, rules)
  return TrainSetup(
      model=model, graphdef=graphdef, abstract_params=nnx.to_pure_dict(abstract),
      param_specs=nnx.to_pure_dict(specs), optimizer=optimizer.for_parameters(abstract),
      mesh=mesh, rules=rules, options=options)
