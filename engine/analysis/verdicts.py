"""Which collectives move bytes off their theory, and why where the reason is known.

    flags = verdicts.off_theory(rows, modes, context)   # rows: comparison.communication_table
    lines = verdicts.markdown(flags)                     # the block at the top of a report
    verdicts.log(flags)                                  # one warning per unexplained row

A row is flagged when a mode's measured / theory ratio is outside [LOW, HIGH], or when it moves
arrays of a kind the theory does not expect. The reports (engine.analysis.compare, engine.bench,
engine.plan) put the flags first, unexplained ones at the top: a ratio far from 1 is the most
interesting line of a report. The known reasons:

- auto mode: XLA's SPMD partitioner chooses its own collectives; the theory is manual mode's
  design (engine/analysis/comm_theory.py), so a difference is the compiler's choice.
- a lower bound: a loop whose trip count is unknown counted once (engine.analysis.collectives).
- manual FSDP on XLA:CPU with layers written out (`model.scan_layers=False`): the compiler drops
  remat's optimization barriers and merges each layer's backward re-gather with its forward
  gather, keeping every layer's gathered weights alive until the backward pass. Explained only
  when the bytes match that prediction (comm_theory's `backward_regather=False`).
- FSDP gathers in the matmuls' operand dtype: the step gathers in `grad_reduce_dtype` and casts
  after; XLA:TPU moves the cast ahead of the gather, which then moves the bytes of the dtype the
  matmuls read (bfloat16 under float32 reductions: 0.50 of the theory; float32 compute too, at
  TPU's default matmul precision). Explained when the ratio is that of the dtypes.
- An all-reduce where the theory reduce-scatters: XLA:TPU reduces gradients (the token
  embedding's, whose lookup transposes to a scatter-add; on small models all of them) whole and
  keeps the shard, moving the axes' size times the bytes. Explained, on both rows, when the
  all-reduce's excess is the reduce-scatter's shortfall times that size.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from absl import logging

from engine.analysis import collectives, comm_theory
from engine.state import TrainSetup

LOW, HIGH = 0.9, 1.1

AUTO = ("auto mode: XLA's SPMD partitioner chose these collectives itself (the theory is manual "
        "mode's design)")
LOWER_BOUND = "a lower bound: a loop's trip count is unknown, so its body was counted once"
CPU_MERGED_REGATHER = (
    'XLA:CPU on layers written out (model.scan_layers=False) merges each layer\'s backward '
    're-gather with its forward gather, so every layer\'s gathered weights stay alive until the '
    'backward pass (about {kept_mib:.2f} MiB per device more than one layer at a time); '
    '--config.model.scan_layers=True gathers one layer at a time, as designed')
CAST_BEFORE_GATHER = (
    'the compiler casts the weights to the dtype its matmuls read before gathering them instead '
    'of after (the step gathers in parallelism.grad_reduce_dtype): {ratio:.2f} of the bytes, the '
    'ratio of the dtypes\' sizes')
ALL_REDUCE_FOR_SCATTER = (
    'the compiler all-reduces gradients whole over {axes} where the theory reduce-scatters them '
    '(the token embedding\'s, whose lookup transposes to a scatter-add; on small models all): '
    'the all-reduce\'s excess is the reduce-scatter\'s shortfall times {size}')


@dataclasses.dataclass(frozen=True)
class Context:
  """What the known reasons depend on: the platform compiled for, whether the layers are
  scanned, and (for the CPU merge) the all-gather bytes that merge predicts, by axes."""
  platform: str
  scan_layers: bool = True
  merged_gather_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  layers: int = 1
  gather_cast_ratio: float = 1.0  # Matmul operands' dtype size / grad_reduce_dtype's.
  axis_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

  def devices(self, axes: str) -> int:
    return math.prod(self.axis_sizes.get(a, 1) for a in axes.split(','))


def context_for(setup: TrainSetup, config, platform: str | None = None) -> Context:
  """The context of `config`'s layout compiled for `platform` (default: its mesh's devices')."""
  platform = platform or setup.mesh.devices.flat[0].platform
  merged = comm_theory.expected_bytes(setup, config.data.global_batch_size, config.data.seq_len,
                                      backward_regather=False)
  itemsize = lambda dtype: np.dtype(dtype).itemsize
  operand = itemsize(setup.options.compute_dtype)
  if platform == 'tpu' and jax.config.jax_default_matmul_precision is None:
    operand = min(operand, 2)  # TPU's default precision feeds float32 matmuls bfloat16.
  return Context(platform, config.model.scan_layers,
                 {','.join(axes): b for (kind, axes), b in merged.items() if kind == 'all-gather'},
                 setup.model.num_layers, operand / itemsize(setup.options.grad_reduce_dtype),
                 dict(setup.mesh.shape))


@dataclasses.dataclass(frozen=True)
class Flag:
  """One (mode, kind, axes) row off its theory."""
  mode: str
  kind: str
  axes: str
  ratio: float | None  # None: a kind the theory does not expect.
  reason: str | None  # None: unexplained.
  variant: str = ''  # The mesh, where a report has several.

  @property
  def explained(self) -> bool:
    return self.reason is not None

  def describe(self) -> str:
    where = f'{self.variant}, ' if self.variant else ''
    amount = ', not in the theory' if self.ratio is None else f' at {self.ratio:.2f}x its theory'
    return f'{where}{self.mode}: {self.kind} over {self.axes}{amount}'


def is_off(entry: dict) -> bool:
  """Whether one mode's entry of a communication row is off its theory."""
  if entry['ratio'] is None:
    return bool(entry['unexpected'])
  return not LOW <= entry['ratio'] <= HIGH


def _near(measured: float, predicted: float) -> bool:
  return predicted > 0 and LOW <= measured / predicted <= HIGH


def _reason(mode: str, row: dict, rows: list[dict], context: Context) -> str | None:
  """The known reason for `mode`'s entry of `row` (among `rows`, the same report's), or None."""
  entry = row[mode]
  if mode.startswith('auto'):
    return AUTO
  if entry.get('lower_bound') and entry['ratio'] is not None and entry['ratio'] < LOW:
    return LOWER_BOUND
  if row['kind'] == 'all-gather':
    merged = context.merged_gather_bytes.get(row['axes'], 0)
    if context.platform == 'cpu' and not context.scan_layers and _near(entry['bytes'], merged):
      per_layer = (row['theory_bytes'] - merged) / max(context.layers, 1)
      return CPU_MERGED_REGATHER.format(kept_mib=per_layer * (context.layers - 1) / 2**20)
    if (context.gather_cast_ratio < 1 and
        _near(entry['bytes'], row['theory_bytes'] * context.gather_cast_ratio)):
      return CAST_BEFORE_GATHER.format(ratio=context.gather_cast_ratio)
  if row['kind'] in ('all-reduce', 'reduce-scatter'):
    same_axes = {r['kind']: r for r in rows if r['axes'] == row['axes'] and mode in r}
    reduce, scatter = same_axes.get('all-reduce'), same_axes.get('reduce-scatter')
    size = context.devices(row['axes'])
    if reduce and scatter and _near(reduce[mode]['bytes'] - reduce['theory_bytes'],
                                    (scatter['theory_bytes'] - scatter[mode]['bytes']) * size):
      return ALL_REDUCE_FOR_SCATTER.format(axes=row['axes'], size=size)
  return None


def off_theory(rows: list[dict], modes: list[str], context: Context,
               variant: str = '') -> list[Flag]:
  """Every (mode, row) off its theory, unexplained ones first."""
  flags = [Flag(mode, row['kind'], row['axes'], row[mode]['ratio'],
                _reason(mode, row, rows, context), variant)
           for row in rows for mode in modes if mode in row and is_off(row[mode])]
  return sorted(flags, key=lambda f: f.explained)


def markdown(flags: list[Flag]) -> list[str]:
  """The report's first section: the flagged rows, unexplained first, or one line that none
  are."""
  out = ['## Collectives off their theory', '']
  flags = sorted(flags, key=lambda f: f.explained)
  if not flags:
    return out + [f'Every collective is within [{LOW}, {HIGH}] of its theory.', '']
  unexplained = sum(not f.explained for f in flags)
  out += [f'{len(flags)} row(s) outside [{LOW}, {HIGH}] of the theory or not in it, '
          f'{unexplained} unexplained:', '']
  out += [f'- **UNEXPLAINED** {f.describe()}.' if not f.explained else
          f'- {f.describe()}: {f.reason}.' for f in flags]
  return out + ['']


def log(flags: list[Flag]) -> None:
  """One warning per unexplained flag, one info line per explained one."""
  for f in flags:
    if f.explained:
      logging.info('Collective off its theory, explained: %s (%s).', f.describe(), f.reason)
    else:
      logging.warning('Collective off its theory, UNEXPLAINED: %s.', f.describe())


def communication_table(runs, theory: dict) -> list[dict]:
  """One row per (kind, axes): each mode's measured bytes, the theory, ratios and flags.
  `lower_bound`: some of the mode's collectives of that row sit in a loop whose trip count is
  unknown (counted once), so its executions, bytes and ratio are lower bounds."""
  measured = {run.mode: collectives.summarize(run.collectives) for run in runs}
  keys = sorted(set(theory) | {k for table in measured.values() for k in table
                                if table[k]['array_bytes']})  # Scalar-only rows say nothing.
  rows = []
  for kind, axes in keys:
    row = {'kind': kind, 'axes': ','.join(axes) or '-', 'theory_bytes': theory.get((kind, axes), 0)}
    for mode, table in measured.items():
      entry = table.get((kind, axes), {'executions': 0, 'array_bytes': 0, 'bytes': 0,
                                       'dtype_bytes': {}, 'ops_in_unknown_loops': 0})
      row[mode] = {'executions': entry['executions'], 'bytes': entry['array_bytes'],
                   'dtype_bytes': entry['dtype_bytes'],
                   'ratio': (entry['array_bytes'] / row['theory_bytes']
                             if row['theory_bytes'] else None),
                   # Not in the theory and moving arrays, not just a loss or a norm.
                   'unexpected': not row['theory_bytes'] and entry['array_bytes'] > 0,
                   'lower_bound': entry['ops_in_unknown_loops'] > 0}
    rows.append(row)
  return rows


# What '>=' means in a communication table (engine.analysis.collectives: unknown trip counts).
LOWER_BOUND_NOTE = ('>= N: a collective of this row sits in a `while` loop whose trip count is '
                    'unknown (neither recorded in the HLO nor readable off the loop); its body is '
                    'counted once, so the count, the bytes and the ratio are lower bounds.')


def lower_bound(entry: dict, text) -> str:
  """`text` as it stands, or '>= text' when `entry` (a mode's communication row) is a lower
  bound."""
  return f'>= {text}' if entry.get('lower_bound') else str(text)


def element_types(entry: dict) -> str:
  """The element types a mode's row moved, by share of its bytes: 's8 94 %, f32 6 %'."""
  by_type = entry.get('dtype_bytes') or {}
  total = sum(by_type.values())
  return ', '.join(f'{t} {100 * b / total:.0f} %' for t, b in
                   sorted(by_type.items(), key=lambda kv: -kv[1])) if total else '-'
