"""Counts the collectives in a compiled step's HLO: kind, mesh axes, executions per step, bytes.

    text = jax.jit(step).lower(*args).compile().as_text()
    table = count_collectives(text, mesh)

Each collective's replica groups (explicit `{{0,1},...}`, iota `[4,2]<=[2,2,2]T(0,2,1)`, or
Shardy's `mesh['axis_0'=2,...] {'axis_0'}`) are turned into the names of the mesh axes the group
spans. Collectives inside `while` bodies (the layer scan, TPU's windowed einsums) count once per
iteration, using XLA's known trip count, or, where the compiled HLO does not record one (XLA:TPU
does not), the trip count read off the loop itself: a counter set to a constant before the loop,
stepped by a constant in the body and compared with a constant in the condition. A loop whose
trip count is neither recorded nor readable has its body counted once, as a lower bound, and
loudly: each collective inside it names the loop (`Collective.unknown_trip_loops`), `summarize`
counts them per row (`ops_in_unknown_loops`), the reports mark those rows as lower bounds, and
one warning per count names the loops. Bytes are per device and per execution: the size of the
collective's result (of an async `-start`, the result part of its (operand, result, context...)
tuple). Collectives between TPU slices, which XLA:TPU compiles to Megascale `send`s over the
data-centre network, are listed under the axis `dcn`. A ragged all-to-all (the dropless
experts' exchange on TPU and GPU) counts as an all-to-all of its whole result buffer: the most it
moves, since the rows it sends depend on the routing.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np
from absl import logging

from engine.analysis import hlo

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 's16': 2, 'u16': 2,
                'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8,
                'c64': 8, 'c128': 16}
_RAGGED = 'ragged-all-to-all'
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (' + '|'.join((_RAGGED, *KINDS)) +
    r'|while|call|conditional|send)(-start)?\((.*)$')
# Between TPU slices XLA:TPU sends through the data-centre network (Megascale) instead: a `send`
# whose attributes name the collective. Such traffic is listed under this pseudo mesh axis.
DCN = 'dcn'
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_SHAPE = re.compile(r'\b(' + '|'.join(_DTYPE_BYTES) + r')\[([\d,]*)\]')


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of the compiled program."""
  kind: str
  axes: tuple[str, ...]  # Mesh axes its groups span, in mesh order.
  shapes: tuple[tuple[int, ...], ...]  # Result buffers (several when XLA combined them).
  buffer_bytes: tuple[int, ...]  # Per device, per execution, one entry per buffer.
  dtypes: tuple[str, ...]  # Each buffer's HLO element type (s8, bf16, f8e4m3fn, ...).
  executions: int  # Per step: 1, or the trip count of the loops it sits in.
  name: str
  computation: str  # The HLO computation it sits in (a loop body, or the entry).
  # The bodies of the `while` loops around it whose trip count is unknown (neither recorded by
  # XLA nor readable off the loop): each counted once, so `executions` is a lower bound.
  unknown_trip_loops: tuple[str, ...] = ()

  @property
  def trip_count_known(self) -> bool:
    """Whether `executions` is exact (False: a lower bound, see `unknown_trip_loops`)."""
    return not self.unknown_trip_loops

  @property
  def buffers(self) -> int:
    return len(self.shapes)

  @property
  def bytes(self) -> int:
    return sum(self.buffer_bytes)

  @property
  def array_bytes(self) -> int:
    """Bytes of the non-scalar buffers: what matters for bandwidth."""
    return sum(b for s, b in zip(self.shapes, self.buffer_bytes) if s)


def _shapes(type_text: str) -> list[tuple[tuple[int, ...], int, str]]:
  """[(dims, bytes, element type)] of every array in an HLO type, in order."""
  out = []
  for dtype, dims in _SHAPE.findall(type_text):
    shape = tuple(int(d) for d in dims.split(',') if d)
    out.append((shape, math.prod(shape) * _DTYPE_BYTES[dtype], dtype))
  return out


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose(perm) if perm else ids


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(',') if x.strip()]


def replica_groups(attrs: str) -> list[list[int]]:
  """The device groups of one collective, from any of XLA's three spellings."""
  if m := re.search(r'replica_groups=\{(\{[\d,\{\}]*\})\}', attrs):
    return [_ints(g) for g in re.findall(r'\{([\d,]*)\}', m.group(1))]
  if m := re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', attrs):
    group_shape = _ints(m.group(1))
    ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
    return ids.reshape(group_shape).tolist()
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\]"
                    r"(?:T\(([\d,]+)\))?\))?(?: \{([^}]*)\})?", attrs):
    names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    sizes = [int(size) for _, size in names]
    grouped = set(re.findall(r"'(\w+)'", m.group(4) or ''))
    ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
           if m.group(2) else np.arange(math.prod(sizes))).reshape(sizes)
    inner = [i for i, (name, _) in enumerate(names) if name in grouped]
    outer = [i for i in range(len(names)) if i not in inner]
    ids = ids.transpose(outer + inner)
    return ids.reshape(-1, math.prod(sizes[i] for i in inner)).tolist()
  if m := re.search(r'source_target_pairs=\{(\{[\d,\{\}]*\})\}', attrs):
    return [_ints(g) for g in re.findall(r'\{([\d,]*)\}', m.group(1))]
  return []


def group_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """Mesh axes along which the members of the groups differ (device id = position in the
  mesh's flattened device order, as in the compiled program's device assignment)."""
  names, sizes = list(mesh_shape), list(mesh_shape.values())
  varying = set()
  for group in groups:
    coords = np.array(np.unravel_index(np.array(group), sizes)).T
    varying.update(names[i] for i in range(len(names)) if len(set(coords[:, i])) > 1)
  return tuple(n for n in names if n in varying)


def _parse(hlo_text: str):
  """computation -> [(name, type, op, is_start, rest of line)] for the ops we follow."""
  computations, current, entry = collections.defaultdict(list), None, None
  for line in hlo_text.splitlines():
    if m := hlo.COMPUTATION.match(line):
      current = m.group(1)
      if line.startswith('ENTRY'):
        entry = current
    elif current and (m := _INSTRUCTION.match(line)):
      computations[current].append(m.groups())
  return computations, entry


def _results(type_text: str, shapes: list) -> list:
  """The result buffers of an async start, (operands, results) on GPU and CPU; XLA:TPU spells
  collective-permute-start (operand, result, u32[], u32[]): its context scalars are left out."""
  end = len(shapes)
  while end > 2 and shapes[end - 1][0] == () and shapes[end - 1][2] in ('u32', 's32'):
    end -= 1
  return shapes[end // 2:end]


def _while_trips(hlo_text: str, parsed: list, computation: str,
                 rest: str) -> tuple[str | None, int | None]:
  """(body, trip count) of one `while` op: XLA's recorded count, else the one read off the loop
  (None when neither); `parsed` is filled with every instruction only when first needed."""
  trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
  body = re.search(r'body=%?([\w.\-]+)', rest)
  cond = re.search(r'condition=%?([\w.\-]+)', rest)
  init = re.match(r'\s*%?([\w.\-]+)\)', rest)
  trips = None
  if trip:
    trips = int(trip.group(1))
  elif body and cond and init:
    if not parsed:
      parsed.extend(hlo.parse_instructions(hlo_text))
    trips = hlo.trip_count(*parsed, computation, init.group(1), cond.group(1),
                                 body.group(1))
  return (body.group(1) if body else None), trips


def _collective(instruction: tuple, mesh_shape: dict[str, int], executions: int,
                computation: str, unknown: tuple[str, ...],
                slices: int = 1) -> Collective | None:
  """The Collective one parsed instruction runs: a `send` counts only when Megascale's (between
  TPU slices, over `dcn`); None otherwise. A Megascale send carries its collective's operand:
  its bytes are put in the result's terms, as every other row's are (an all-gather's result is
  `slices` operands, a reduce-scatter's 1 / `slices` of one; `slices`: the mesh's, which the
  send spans where one mesh axis crosses them)."""
  name, type_text, op, is_start, rest = instruction
  shapes = _shapes(type_text)
  if op == 'send':
    if not (m := _MEGASCALE.search(rest)):
      return None
    kind, axes = m.group(1).lower().replace('_', '-'), (DCN,)  # ALL_REDUCE -> all-reduce, ...
    scale = {'all-gather': slices, 'reduce-scatter': 1 / slices}.get(kind, 1)
    shapes = [(shape, round(size * scale), dtype) for shape, size, dtype in shapes]
  else:
    if is_start and op in ('all-gather', 'collective-permute', 'all-to-all'):
      shapes = _results(type_text, shapes)
    kind, axes = ('all-to-all' if op == _RAGGED else op), group_axes(replica_groups(rest),
                                                                     mesh_shape)
  return Collective(
      kind=kind, axes=axes, shapes=tuple(s for s, _, _ in shapes),
      buffer_bytes=tuple(b for _, b, _ in shapes), dtypes=tuple(d for _, _, d in shapes),
      executions=executions, name=name,
      computation=computation, unknown_trip_loops=unknown)


def _warn_unknown_loops(found: list[Collective]) -> None:
  """One warning naming every loop of unknown trip count that holds collectives, so the lower
  bounds are never silent."""
  loops = sorted({loop for c in found for loop in c.unknown_trip_loops})
  if loops:
    affected = sum(1 for c in found if c.unknown_trip_loops)
    logging.warning(
        'Collective count: the trip count of %d while loop(s) is neither recorded in the HLO '
        'nor readable off the loop (body: %s); their bodies are counted once, so the executions '
        'and bytes of the %d collective(s) inside them are lower bounds.', len(loops),
        ', '.join(loops), affected)


def count_collectives(hlo_text: str, mesh) -> list[Collective]:
  """Every collective the compiled program runs per step, with the mesh axes it spans.

  A collective inside a loop of unknown trip count is counted once per execution of the code
  around the loop (a lower bound) and carries the loop's body in `unknown_trip_loops`; one
  warning names every such loop that holds collectives."""
  mesh_shape = dict(mesh.shape)
  devices = getattr(mesh, 'devices', None)  # None: a mesh's shape alone (one slice).
  slices = 1 if devices is None else len({getattr(d, 'slice_index', 0) for d in devices.flat})
  computations, entry = _parse(hlo_text)
  parsed = []  # Every instruction, parsed only when a loop lacks a known trip count.
  found: list[Collective] = []

  def visit(computation: str, executions: int, unknown: tuple[str, ...] = (), depth: int = 0):
    if depth > 32:
      return
    for instruction in computations.get(computation, ()):
      op, rest = instruction[2], instruction[4]
      if op == 'while':
        body, trips = _while_trips(hlo_text, parsed, computation, rest)
        if body:
          if trips is None:  # Unknown: the body once, a lower bound, and said so.
            visit(body, executions, unknown + (body,), depth + 1)
          else:
            visit(body, executions * trips, unknown, depth + 1)
      elif op in ('call', 'conditional'):
        for callee in re.findall(r'(?:to_apply|calls|branch_computations)=\{?%?([\w.\-]+)', rest):
          visit(callee, executions, unknown, depth + 1)
      elif collective := _collective(instruction, mesh_shape, executions, computation, unknown,
                                     slices):
        found.append(collective)

  visit(entry, 1)
  _warn_unknown_loops(found)
  return found


def summarize(collectives: list[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
  """(kind, axes) -> {'ops', 'executions', 'buffers', 'bytes', 'array_bytes', 'dtype_bytes',
  'ops_in_unknown_loops'} per step (`array_bytes` leaves out scalar buffers such as losses and
  norms; `dtype_bytes` splits them by element type, {'s8': ..., 'f32': ...}).
  `ops_in_unknown_loops` counts the row's ops inside a loop of unknown trip count: when it is
  above 0, executions, buffers and bytes are lower bounds."""
  table = collections.defaultdict(
      lambda: {'ops': 0, 'executions': 0, 'buffers': 0, 'bytes': 0, 'array_bytes': 0,
               'dtype_bytes': collections.Counter(), 'ops_in_unknown_loops': 0})
  for c in collectives:
    row = table[(c.kind, c.axes)]
    row['ops'] += 1
    row['ops_in_unknown_loops'] += 0 if c.trip_count_known else 1
    row['executions'] += c.executions
    row['buffers'] += c.buffers * c.executions
    row['bytes'] += c.bytes * c.executions
    row['array_bytes'] += c.array_bytes * c.executions
    for shape, size, dtype in zip(c.shapes, c.buffer_bytes, c.dtypes):
      if shape:
        row['dtype_bytes'][dtype] += size * c.executions
  return {key: {**row, 'dtype_bytes': dict(row['dtype_bytes'])}
          for key, row in sorted(table.items())}


@dataclasses.dataclass(frozen=True)
class Requested:
  """A collective as the program asks for it (jaxpr), before the compiler rewrites it."""
  primitive: str  # psum (psum_invariant), reduce_scatter, all_gather, pmax, ppermute, ...
  axes: tuple[str, ...]
  dtype: str
  shape: tuple[int, ...]


_COLLECTIVE_PRIMITIVES = ('psum', 'psum_invariant', 'pmax', 'pmin', 'reduce_scatter',
                          'all_gather', 'all_to_all', 'ppermute')


def requested_collectives(closed_jaxpr) -> list[Requested]:
  """Every collective in a traced program (`jax.make_jaxpr(step)(*args)`), nested jaxprs (scan,
  remat, shard_map) included, each listed once per appearance. Compilers may change dtypes:
  XLA:CPU, for one, promotes bfloat16 all-reduces and reduce-scatters to float32."""
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in _COLLECTIVE_PRIMITIVES:
        axes = eqn.params.get('axes', eqn.params.get('axis_name', ()))
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        for var in eqn.invars:
          found.append(Requested(eqn.primitive.name, axes, str(var.aval.dtype),
                                 tuple(var.aval.shape)))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else (param,):
          inner = getattr(sub, 'jaxpr', sub)
          if hasattr(inner, 'eqns'):
            visit(inner)

  visit(closed_jaxpr.jaxpr)
  return found
