"""The communication theory (engine/analysis/comm_theory.py) as a step over several slices runs it.

A collective over a mesh axis split across slices (mesh.dcn_data, mesh.dcn_fsdp) runs in two
levels, as XLA:TPU lowers it: inside each slice over the interconnect and between slices over
the data-centre network (the `dcn` pseudo axis of engine.analysis.collectives). An all-reduce of
B bytes over a group of g devices in each of n slices is a reduce-scatter in the slice (B / g),
an all-reduce of that shard between slices and an all-gather in the slice (B); an all-gather
sends the slice's B / g between slices first; a reduce-scatter of a B-byte shard reduces B n in
the slice, then B between slices; an all-to-all's B go both ways. Units are the theory's: bytes
of each collective's result on one device per step, keyed by (kind, mesh axes).
"""

from __future__ import annotations

import collections
import math

from engine.analysis.collectives import DCN

Key = tuple[str, tuple[str, ...]]


def split(expected: dict[Key, int], mesh_shape: dict[str, int], mesh_config) -> dict[Key, int]:
  """`expected` as a step over several slices runs it: each collective over an axis split across
  slices (mesh.dcn_data, mesh.dcn_fsdp of `mesh_config`) as its part in the slice (same key: its
  group is then the slice's part of the axes) and its part between slices (the `dcn` axis)."""
  dcn = {axis: mesh_config.get(f'dcn_{axis}', 1) for axis in ('data', 'fsdp')}
  parts: dict[Key, int] = collections.defaultdict(int)
  for (kind, axes), size in expected.items():
    slices = math.prod(dcn.get(a, 1) for a in axes)
    if slices == 1 or kind == 'collective-permute':
      parts[(kind, axes)] += size
      continue
    group = math.prod(mesh_shape[a] for a in axes) // slices  # Devices in each slice.
    between, within = {  # The result's bytes between slices, and in each slice.
        'all-reduce': (size // group, size), 'all-gather': (size // group, size),
        'reduce-scatter': (size, size * slices), 'all-to-all': (size, size)}[kind]
    parts[(kind, (DCN,))] += between
    if group > 1 and kind == 'all-reduce':  # Reduce-scattered in the slice, gathered after.
      parts[('reduce-scatter', axes)] += between
      parts[('all-gather', axes)] += within
    elif group > 1:
      parts[(kind, axes)] += within
  return dict(parts)
