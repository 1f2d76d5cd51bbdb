"""The communication a layout needs in theory, per step and per device, for any registered model.

It reads only the model's spec (engine/models/spec.py: width, depth, the dimensions its
row-parallel matmuls contract) and the parameter table (by logical dimension names: the head
counts), never a parameter's name.

Units match engine.analysis.collectives: bytes of each collective's result on one device, summed
over its executions in one step. Keys are (kind, mesh axes).

- Data parallel: one all-reduce of every gradient over the batch axes its parameter is
  replicated on (the local gradient shard's size).
- FSDP: every gathered matrix of a stacked layer all-gathered twice (forward, and again in the
  backward pass under remat), every other parameter once (before the model runs, kept for the
  backward pass), and each gradient reduce-scattered once. A stacked layer's vector split over
  FSDP is a bias (the norms' scales are never split), and a bias' gradient needs no bias: the
  backward pass does not gather it again. With several micro-batches every parameter is
  gathered once per optimizer step (and its gradient still reduce-scattered once).
  `backward_regather=False` predicts a compiler that merges the backward pass' re-gathers with
  the forward's (XLA:CPU on layers written out, `model.scan_layers=False`: it drops remat's
  optimization barriers, and its common-subexpression elimination then keeps every layer's
  gathered weights alive until the backward pass).
  A token embedding only the lookup reads (ModelSpec.untied_embeddings), in a step without
  micro-batches or stages, is never gathered (engine/parallel/manual_ops.py: columns_lookup_axes):
  the FSDP group's int32 tokens are all-gathered and the rows [batch, length, embed] travel once
  each way in an all-to-all. Under a chunked loss (model.loss_chunks) the head is not gathered
  either: it is exchanged to a slice of the vocabulary for every embedding dimension (an
  all-to-all each way, compute dtype); each chunk's features and int32 targets are all-gathered
  over the group (again where the chunk's backward pass recomputes it), the features' gradient
  reduce-scattered, the gathered rows' loss gradients [group x batch, length] all-reduced, and
  the loss' reductions cover the group's rows.
- Per layer means per layer a device runs: with pipeline stages, its stage's layers on every
  iteration of the schedule, bubbles included (`executed_layers`).
- Micro-batches change none of the rest: gradients are synchronised once per optimizer step,
  and activation reductions move the same bytes in k slices.
- Megatron tensor parallel: per layer and per row-parallel matmul, one all-reduce of the
  activations [batch, length, embed] in the forward pass (its partial sums) and one in the
  backward (the gradient of its column-parallel partner's replicated input); with a
  vocab-parallel embedding and loss, one more activation all-reduce each way plus three
  [batch, length] reductions for the cross-entropy (max, sum of exponentials, target logit).
- Context parallel (ring attention, engine/parallel/context.py): per layer, each device's keys
  and values [batch, length / context, kv heads, head_dim] (the key / value heads its query
  heads read: N / tensor where `kv_heads` split, else those of its query heads' groups, all N
  without tensor; replicated ones' weight gradients are then all-reduced over `tensor`, once,
  in the compute dtype) move context - 1 times around the ring, and their gradients move back as
  often; under remat the forward pass, and its permutes, run twice. The sequence's devices count
  as batch axes for the gradient all-reduce, and every activation above is 1 / context as long.
- Pipeline (engine/parallel/pipeline/gpipe.py): the activations of one micro-batch
  [batch / microbatches, length, embed] move to the next stage repeats x microbatches +
  stages - 2 times in the forward pass and as often back (repeats = 1: GPipe; > 1: the circular
  schedule); the last stage's output [batch, length, embed] is
  broadcast to every stage (one all-reduce), and the embedding's gradient gathered back from
  stage 0 (another). The 1F1B schedule, plain or interleaved
  (engine/parallel/pipeline/one_f_one_b.py: pipeline_repeats plays repeats' part), moves the same
  activations and cotangents, and instead of those two sums the gradients of every weight
  outside the stack over the stages (float32, each device's shard); its backward ticks run each
  layer's forward pass again, so a row-parallel layer's all-reduces are 3 per layer, not 2.
  With the head split over the stages (train.pipeline_head), each finished micro-batch's
  output is reduce-scattered to the stages (by rows or positions) and its cotangent
  all-gathered back (with a mixture of experts, its per-layer loads broadcast from the last
  stage), and the head's vocab-parallel reductions cover 1 / stages of them. Stacked layers'
  gradients are split over `stage`, so each stage reduces only its own, once per step. Under
  FSDP every weight outside the stack is gathered once per step, as with micro-batches, and a
  stage's layers in every tick that runs them: once in a forward tick and twice in a backward
  one (the recomputed forward pass, then the backward pass; manual FSDP never keeps gathered
  weights), 3 (groups x microbatches + stages - 1) / groups times a step, each tick one group's.
- Expert parallel (engine/parallel/expert_exchange.py): per layer, the experts' buffer goes to
  the devices holding the experts and back (one all-to-all each way) in every forward pass (two
  under remat) and once each way in the backward pass. The buffer is the capacity dispatch's
  [E, local batch, C, embed] slots, or dropless' n blocks of (local tokens x min(k, E / n))
  rows. On CPU the rows' int32 local expert ids travel too (forward only); on TPU and GPU, whose
  ragged all-to-alls the collective count takes at their whole buffer, the counts per (device,
  expert) instead, and in the backward pass the two int32 offset vectors [n] the ragged moves'
  transposes exchange. Auto mode's dropless dispatch runs the same exchange there (outside
  pipelines), and pads to C = length elsewhere (E / k times the capacity-1 buffer): the theory
  is manual mode's.
  With tensor parallelism the experts' down projection all-reduces the routed rows (forward)
  instead of [batch, length, embed], and the backward pass all-reduces the layer's input once.
  The router's batch statistics (the load-balancing loss' two [E] means) are averaged over the
  batch axes in every execution of a layer, float32; with pipeline stages each micro-batch's
  per-layer loads [layers, E] travel with its activations and are broadcast with its output.
Scalar reductions (loss, gradient norms) are left out: they are a few bytes.

Dtypes follow manual mode's design: gradient reductions and the FSDP gathers they transpose in
`parallelism.grad_reduce_dtype` (the gathers in one byte per value with `parallelism.gather_dtype`
int8 or fp8, and an all-reduce of each weight's float32 channel scales), activations in the
compute dtype, the loss terms in float32.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from engine.models.moe.dispatch import capacity
from engine.models.ops import LAYERS
from engine import muon
from engine.parallel import expert_exchange, flat_gather, manual_ops, muon_blocks, zero1
from engine.parallel.pipeline.gpipe import SELF_DIFFERENTIATING
from engine.sharding import spec_axes
from engine.state import TrainSetup

Key = tuple[str, tuple[str, ...]]
FLOAT32_BYTES = INT32_BYTES = 4
# The [E] vectors a mixture of experts' layer averages over the batch (engine/models/moe/layer.py).
ROUTER_STATISTICS = 2


def _ordered(axes, mesh_axes) -> tuple[str, ...]:
  return tuple(a for a in mesh_axes if a in axes)


def expected_bytes(setup: TrainSetup, global_batch: int, seq_len: int,
                   backward_regather: bool = True) -> dict[Key, int]:
  mesh_shape = dict(setup.mesh.shape)
  names = tuple(mesh_shape)
  rules = setup.rules
  context_axes = rules.mesh_axes('length', activation=True)
  context = math.prod(mesh_shape[a] for a in context_axes)
  local_batch = global_batch // math.prod(
      mesh_shape[a] for a in rules.mesh_axes('batch', activation=True))
  seq_len //= context  # Each device's part of every sequence.
  batch_axes = rules.mesh_axes('batch', activation=True) + context_axes
  expected: dict[Key, int] = collections.defaultdict(int)
  activation_bytes = np.dtype(setup.options.compute_dtype).itemsize
  _add_parameter_collectives(setup, expected, batch_axes, backward_regather)

  model = setup.model
  activation = local_batch * seq_len * model.embed_dim * activation_bytes
  layers = executed_layers(setup)
  # A row-parallel layer's sum in each forward pass, its column-parallel input's in the backward.
  passes = 3 if _self_differentiating(setup) and rules.mesh_axes(LAYERS) else 2
  for contracted in model.row_parallel_per_layer:
    row_parallel = _ordered(rules.mesh_axes(contracted, activation=True), names)
    if row_parallel:
      expected[('all-reduce', row_parallel)] += round(passes * layers * activation)
  for contracted in ('heads', 'mlp') if model.first_layers else ():  # Once, before the stack.
    row_parallel = _ordered(rules.mesh_axes(contracted, activation=True), names)
    if row_parallel:
      expected[('all-reduce', row_parallel)] += round(2 * model.first_layers * activation)
  if context > 1:
    keys_or_values = (local_batch * seq_len * math.prod(_ring_heads(setup))
                      * activation_bytes)
    forward_passes = 1 if setup.options.remat == 'none' else 2
    expected[('collective-permute', _ordered(context_axes, names))] += round(
        (layers * (forward_passes + 1) + 2 * model.first_layers)  # Those not rematerialised.
        * (context - 1) * 2 * keys_or_values)
  stage_axes = _ordered(rules.mesh_axes(LAYERS), names)
  if stage_axes:
    stages = math.prod(mesh_shape[a] for a in stage_axes)
    microbatches, repeats = setup.options.microbatches, model.layer_groups
    expected[('collective-permute', stage_axes)] += (
        2 * (repeats * microbatches + stages - 2) * activation // microbatches)
    if _self_differentiating(setup):
      expected[('all-reduce', stage_axes)] += _outer_gradient_bytes(setup)
      if head_split(setup, local_batch, seq_len * context):
        # Each micro-batch's output dealt out to the stages, its cotangent gathered back.
        expected[('reduce-scatter', stage_axes)] += activation // stages
        expected[('all-gather', stage_axes)] += activation
    else:
      expected[('all-reduce', stage_axes)] += 2 * activation
  if model.experts is not None:
    _add_expert_exchange(setup, expected, local_batch, seq_len, activation_bytes)
  _add_embedding_and_loss(setup, expected, local_batch, seq_len, context, activation)
  return dict(expected)


def _add_embedding_and_loss(setup: TrainSetup, expected, local_batch: int, seq_len: int,
                            context: int, activation: int) -> None:
  """The token embedding's lookup and the head's loss: manual FSDP's exchanges for an untied
  embedding and a chunked head, and the vocabulary-parallel sums. `seq_len`: this device's part
  of each sequence; `activation`: the bytes of one [local batch, seq_len, embed] activation."""
  mesh_shape, rules = dict(setup.mesh.shape), setup.rules
  names = tuple(mesh_shape)
  tokens = local_batch * seq_len  # This device's positions.
  lookup_axes = _ordered(manual_ops.columns_lookup_axes(setup), names)
  if lookup_axes:  # The group's tokens gathered, their rows sent home and back.
    group = math.prod(mesh_shape[a] for a in lookup_axes)
    expected[('all-gather', lookup_axes)] += group * tokens * INT32_BYTES
    expected[('all-to-all', lookup_axes)] += 2 * activation
  vocab_parallel = _ordered(rules.mesh_axes('vocab', activation=True), names)
  head_slice_axes = _ordered(manual_ops.chunked_head_axes(setup), names)
  group = math.prod(mesh_shape[a] for a in head_slice_axes)  # The rows a device's loss covers.
  if head_slice_axes:  # Each chunk's features and targets gathered, again in its backward pass.
    expected[('all-gather', head_slice_axes)] += 2 * group * (
        activation + tokens * INT32_BYTES)
    expected[('reduce-scatter', head_slice_axes)] += activation
    # The gathered rows' loss gradients summed (each device's loss reads its own rows).
    expected[('all-reduce', head_slice_axes)] += group * tokens * FLOAT32_BYTES
  loss_axes = _ordered(vocab_parallel + head_slice_axes, names)
  # The head's (its input's gradient, the loss' reductions) on each stage's share where the
  # head is split.
  head_share = 1 / _stages(setup) if head_split(setup, local_batch, seq_len * context) else 1
  if vocab_parallel:  # The embedding's sum in the forward pass, the head input's gradient's.
    expected[('all-reduce', vocab_parallel)] += round(activation + head_share * activation)
  if loss_axes:  # Max, sum of exponentials, target logit; a chunk's first two again where its
    # backward pass recomputes it.
    reductions = 5 if setup.options.loss_chunks > 1 else 3
    expected[('all-reduce', loss_axes)] += round(
        head_share * reductions * group * tokens * FLOAT32_BYTES)


def _self_differentiating(setup: TrainSetup) -> bool:
  """Whether the pipeline schedule takes its gradients itself (1F1B, plain or interleaved)."""
  return setup.options.pipeline_schedule in SELF_DIFFERENTIATING


def _stages(setup: TrainSetup) -> int:
  mesh_shape = dict(setup.mesh.shape)
  return math.prod(mesh_shape[a] for a in setup.rules.mesh_axes(LAYERS))


def head_split(setup: TrainSetup, local_batch: int, seq_len: int) -> bool:
  """Whether 1F1B splits the head over the stages: train.pipeline_head='split' and each
  micro-batch's local rows, or else its positions (the whole sequence on each device), a
  multiple of the stages (engine.parallel.pipeline.one_f_one_b.head_axis, on the shapes)."""
  stages = _stages(setup)
  if not (_self_differentiating(setup) and stages > 1 and
          setup.options.pipeline_head == 'split'):
    return False
  mesh_shape = dict(setup.mesh.shape)
  context = math.prod(mesh_shape[a] for a in setup.rules.mesh_axes('length', activation=True))
  return (local_batch // setup.options.microbatches % stages == 0 or
          (context == 1 and seq_len % stages == 0))


def _one_f_one_b_gathers(setup: TrainSetup) -> float:
  """How many times 1F1B gathers a stage's FSDP-split layers per step (the module docstring):
  each of the groups x microbatches + stages - 1 forward ticks gathers one group's layers
  once, each backward tick twice."""
  groups = setup.model.layer_groups
  return 3 * (groups * setup.options.microbatches + _stages(setup) - 1) / groups


def _outer_gradient_bytes(setup: TrainSetup) -> int:
  """The 1F1B pipeline's sum over `stage` of the gradients of the weights outside the stack
  (the embedding's from the first stage, the head's from the last): float32, each device's
  shard (engine/parallel/pipeline/one_f_one_b.py)."""
  return FLOAT32_BYTES * sum(math.prod(p.shard_shape) for p in setup.parameters()
                             if LAYERS not in p.logical_axes)


def _add_parameter_collectives(setup: TrainSetup, expected, batch_axes,
                               backward_regather: bool) -> None:
  """Each parameter's own collectives: its gradient's all-reduce over the batch axes it is
  replicated on (and over the heads' axes for replicated key / value heads), its FSDP gathers
  and its gradient's reduce-scatter, and under Muon its matrix's gathers for the update."""
  mesh_shape, rules = dict(setup.mesh.shape), setup.rules
  names = tuple(mesh_shape)
  reduce_bytes = np.dtype(setup.options.grad_reduce_dtype).itemsize
  activation_bytes = np.dtype(setup.options.compute_dtype).itemsize
  head_axes = _ordered(rules.mesh_axes('heads', activation=True), names)
  kv_replicated = not rules.mesh_axes('kv_heads', activation=True)
  lookup_table = bool(manual_ops.columns_lookup_axes(setup))
  head_slice_axes = _ordered(manual_ops.chunked_head_axes(setup), names)
  for p in setup.parameters():
    shard_bytes = math.prod(p.shard_shape) * reduce_bytes
    split = set(spec_axes(p.spec))
    replicated = _ordered([a for a in batch_axes if a not in split], names)
    extra, _ = zero1.split(p.spec, p.moment_spec or p.spec)
    if extra:  # ZeRO-1: reduce-scattered to the moments' block, the updated blocks gathered.
      block = shard_bytes // math.prod(mesh_shape[a] for a in extra)
      expected[('reduce-scatter', _ordered(extra, names))] += block
      rest = _ordered([a for a in replicated if a not in extra], names)
      if rest:
        expected[('all-reduce', rest)] += block
      expected[('all-gather', _ordered(extra, names))] += math.prod(p.shard_shape) * FLOAT32_BYTES
    elif replicated:
      expected[('all-reduce', replicated)] += shard_bytes
    if head_axes and kv_replicated and 'kv_heads' in p.logical_axes:
      # Key / value heads replicated under split query heads: each device's gradient covers
      # only the kv heads its query heads read; summed over the heads' axes (compute dtype).
      expected[('all-reduce', head_axes)] += math.prod(p.shard_shape) * activation_bytes
    dims = muon.dimension_numbers(p.logical_axes) if setup.optimizer.build else None
    if dims is not None:  # Muon: the update's and momentum's float32 blocks made whole.
      plan = muon_blocks.matrix_plan(p.spec, dims, p.shard_shape, mesh_shape)
      size = math.prod(p.shard_shape) * FLOAT32_BYTES
      for _, axes in plan.splits:
        if plan.stack_dim is not None:  # Exchanged there and back, the block's size each time.
          expected[('all-to-all', _ordered(axes, names))] += 4 * size
        else:
          size *= math.prod(mesh_shape[a] for a in axes)
          expected[('all-gather', _ordered(axes, names))] += 2 * size
    gathered = _ordered({a for name in p.logical_axes for a in rules.gather_axes(name)}, names)
    if lookup_table and tuple(p.logical_axes) == manual_ops.EMBEDDING_AXES:
      gathered = ()  # Looked up on each device's columns: neither gathered nor reduce-scattered.
    if head_slice_axes and tuple(p.logical_axes) == manual_ops.HEAD_AXES:
      gathered = ()  # Exchanged to a slice of the vocabulary, and its gradient back.
      expected[('all-to-all', head_slice_axes)] += (
          2 * math.prod(p.shard_shape) * activation_bytes)
    if gathered:
      factor = math.prod(mesh_shape[a] for a in gathered)
      regathered = (backward_regather and setup.options.microbatches == 1
                    and LAYERS in p.logical_axes and len(p.shape) > 2  # Not a stacked bias.
                    and not _keeps_dequantized_weights(setup))
      gathers = 2 if regathered else 1
      if LAYERS in p.logical_axes and _self_differentiating(setup) and rules.mesh_axes(LAYERS):
        gathers = _one_f_one_b_gathers(setup)
      expected[('all-gather', gathered)] += round(gathers * _gathered_bytes(setup, p) * factor)
      expected[('reduce-scatter', gathered)] += shard_bytes
      if setup.options.gather_dtype != 'default':  # The channels' scales, a pmax per gather.
        expected[('all-reduce', gathered)] += gathers * _scale_bytes(setup, p)


def _keeps_dequantized_weights(setup: TrainSetup) -> bool:
  """Quantized gathers under model.remat='none' keep the dequantized weights for the backward
  pass (engine/parallel/quantized_gather.py): no re-gather."""
  return setup.options.gather_dtype != 'default' and setup.options.remat == 'none'


def _gathered_bytes(setup: TrainSetup, p) -> int:
  """What one FSDP gather of parameter `p` sends per device: its shard in the reduction dtype,
  or one byte per value (parallelism.gather_dtype: engine/parallel/quantized_gather.py)."""
  values = math.prod(p.shard_shape)
  if setup.options.gather_dtype == 'default':
    return values * np.dtype(setup.options.grad_reduce_dtype).itemsize
  return values


def _scale_bytes(setup: TrainSetup, p) -> int:
  """A quantized gather's float32 scales: one per position outside the split dimensions."""
  split = {dim for dim, _ in flat_gather.split_dims(setup.rules, p.logical_axes)}
  return 4 * math.prod(size for dim, size in enumerate(p.shard_shape) if dim not in split)


def executed_layers(setup: TrainSetup) -> float:
  """Layers one device runs per step, in whole local batches: all of them, or with pipeline
  stages its stage's L / S on every iteration of the schedule, bubbles included (R x M + S - 1
  iterations of a micro-batch through L / (S x R) layers, R layer groups, M micro-batches): of
  the stacked layers only, not the model's first_layers."""
  model = setup.model
  stages, stacked = _stages(setup), model.num_layers - model.first_layers
  if stages == 1:
    return stacked
  items = model.layer_groups * setup.options.microbatches
  return stacked / stages * (items + stages - 1) / items


def _ring_heads(setup: TrainSetup) -> tuple[int, int]:
  """(key / value heads one device passes around the ring, head_dim), as ManualOps'
  kv_for_query_heads keeps them: the heads read from the stacked projections' logical names
  ('kv_heads' for grouped-query attention, else the query 'heads')."""
  rules, mesh_shape = setup.rules, dict(setup.mesh.shape)
  sizes = {}
  for p in setup.parameters():
    if LAYERS in p.logical_axes and 'head_dim' in p.logical_axes:
      sizes.update({n: d for n, d in zip(p.logical_axes, p.shape) if n != LAYERS})
  ways = lambda name: math.prod(mesh_shape[a] for a in rules.mesh_axes(name, activation=True))
  heads, head_dim = sizes['heads'], sizes['head_dim']
  kv_heads = sizes.get('kv_heads', heads)
  if 'kv_heads' not in sizes or ways('kv_heads') > 1 or ways('heads') == 1:
    return kv_heads // (ways('kv_heads') if 'kv_heads' in sizes else ways('heads')), head_dim
  group, local = heads // kv_heads, heads // ways('heads')  # Replicated kv heads.
  if local % group == 0 or group % local == 0:
    return max(local // group, 1), head_dim
  return local, head_dim


def _add_expert_exchange(setup: TrainSetup, expected, local_batch: int, seq_len: int,
                         activation_bytes: int) -> None:
  """The all-to-alls of the experts' exchange, and the tensor axis' reductions of routed rows."""
  mesh_shape, rules, model = dict(setup.mesh.shape), setup.rules, setup.model
  names, experts = tuple(mesh_shape), model.experts
  E, K = experts.num_experts, experts.experts_per_token
  expert_axes = _ordered(rules.mesh_axes('experts', activation=True), names)
  n = math.prod(mesh_shape[a] for a in expert_axes)
  offset_bytes = 0
  if experts.capacity_factor:
    rows = E * local_batch * capacity(seq_len, K, E, experts.capacity_factor)
    id_bytes = 0
  else:
    rows = n * local_batch * seq_len * min(K, E // n)
    id_bytes = rows * 4 if expert_axes else 0
    if expert_axes and expert_exchange.exchange_kind(setup) == expert_exchange.RAGGED:
      id_bytes, offset_bytes = E * 4, 2 * n * 4  # Counts [n, E / n]; offsets [n], twice.
  forward_passes = 1 if setup.options.remat == 'none' else 2
  stage_axes = rules.mesh_axes(LAYERS)
  stages = _stages(setup)
  items = model.layer_groups * setup.options.microbatches if stages > 1 else 1
  layers = executed_layers(setup)
  # The statistics are per execution of a layer: once per micro-batch (and pipeline iteration).
  executions = layers * (items if stages > 1 else setup.options.microbatches)
  row_bytes = rows * model.embed_dim * activation_bytes
  batch_axes = _ordered(rules.mesh_axes('batch', activation=True) +
                        rules.mesh_axes('length', activation=True), names)
  if batch_axes:
    expected[('all-reduce', batch_axes)] += round(
        executions * forward_passes * ROUTER_STATISTICS * E * FLOAT32_BYTES)
  if stages > 1:  # Each micro-batch's per-layer loads [L, E] ride the pipeline (forward).
    load_bytes = (model.num_layers - model.first_layers) * E * FLOAT32_BYTES
    stage_axes = _ordered(stage_axes, names)
    microbatches = setup.options.microbatches
    expected[('collective-permute', stage_axes)] += (items + stages - 2) * load_bytes
    # GPipe broadcasts each micro-batch's from the last stage; 1F1B sums their mean once.
    once = _self_differentiating(setup)
    expected[('all-reduce', stage_axes)] += (1 if once else microbatches) * load_bytes
    if head_split(setup, local_batch, seq_len):  # And to the stages that share its head.
      expected[('all-reduce', stage_axes)] += microbatches * load_bytes
  if expert_axes:
    expected[('all-to-all', expert_axes)] += round(layers * (
        (2 * forward_passes + 2) * row_bytes + forward_passes * id_bytes + offset_bytes))
  tensor_axes = _ordered(rules.mesh_axes('mlp', activation=True), names)
  if tensor_axes:
    activation = local_batch * seq_len * model.embed_dim * activation_bytes
    expected[('all-reduce', tensor_axes)] += round(
        layers * (row_bytes + (0 if experts.shared_expert else activation)))
