"""The communication a layout needs in theory, per step and per device, for the GPT model.

Units match engine.collectives: bytes of each collective's result on one device, summed over
its executions in one step. Keys are (kind, mesh axes).

- Data parallel: one all-reduce of every gradient over the batch axes its parameter is
  replicated on (the local gradient shard's size).
- FSDP: every gathered parameter all-gathered twice (forward, and again in the backward pass
  under remat), and its gradient reduce-scattered once.
- Megatron tensor parallel: two all-reduces of a block's activations [batch, length, embed] per
  block in the forward pass and two in the backward; with a vocab-parallel embedding and loss,
  one more activation all-reduce each way plus three [batch, length] reductions for the
  cross-entropy (max, sum of exponentials, target logit).
Scalar reductions (loss, gradient norms) are left out: they are a few bytes.
"""

from __future__ import annotations

import collections
import math

from engine.state import StateLayout

Key = tuple[str, tuple[str, ...]]
FLOAT_BYTES = 4


def _ordered(axes, mesh_axes) -> tuple[str, ...]:
  return tuple(a for a in mesh_axes if a in axes)


def expected_bytes(layout: StateLayout, global_batch: int, seq_len: int) -> dict[Key, int]:
  mesh_shape = dict(layout.mesh.shape)
  names = tuple(mesh_shape)
  rules = layout.rules
  batch_axes = rules.mesh_axes('batch', activation=True)
  local_batch = global_batch // math.prod(mesh_shape[a] for a in batch_axes)
  expected: dict[Key, int] = collections.defaultdict(int)

  for p in layout.parameters():
    split = {a for entry in p.spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
    replicated = _ordered([a for a in batch_axes if a not in split], names)
    if replicated:
      expected[('all-reduce', replicated)] += p.bytes_per_device
    gathered = _ordered({a for name in p.logical_axes for a in rules.gather_axes(name)}, names)
    if gathered:
      factor = math.prod(mesh_shape[a] for a in gathered)
      expected[('all-gather', gathered)] += 2 * p.bytes_per_device * factor
      expected[('reduce-scatter', gathered)] += p.bytes_per_device

  row_parallel = _ordered(rules.mesh_axes('heads', activation=True), names)
  embed = layout.abstract_params['tok_embed_VD'].shape[1]
  layers = layout.abstract_params['blocks']['w_up_DF'].shape[0]
  activation = local_batch * seq_len * embed * FLOAT_BYTES
  if row_parallel:
    expected[('all-reduce', row_parallel)] += 4 * layers * activation
  vocab_parallel = _ordered(rules.mesh_axes('vocab', activation=True), names)
  if vocab_parallel:
    expected[('all-reduce', vocab_parallel)] += (
        2 * activation + 3 * local_batch * seq_len * FLOAT_BYTES)
  return dict(expected)
