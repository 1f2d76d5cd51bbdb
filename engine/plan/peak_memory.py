"""What a compiled train step's memory is made of, from the compiler's own reports
(`engine.plan --memory_breakdown`).

XLA, libtpu's included, writes for every program it compiles with `dump_options`: the memory
layout of its peak (`*-memory-usage-report.txt`: the chunks of device memory, each with the
shapes of the values that take turns in it; on a large step it lays out less than all of the
temporaries the compiled program reports), the buffers live at that peak (`*-live-range.txt`)
and the program after optimisation (`*after_optimizations.txt`), whose instructions carry the
JAX op names they came from. `breakdown` lists the largest chunks with their shapes and, from a
live buffer of one of those shapes, the op name that made it: what libtpu's out-of-memory
report lists on a device, for a program that fits too, and for one that does not (libtpu's
ahead-of-time compile reports only the total then).
"""

from __future__ import annotations

import glob
import os
import re

# HloLiveRange's peak section: `  name{index}: 123 bytes (cumulative: 456 bytes)`.
_PEAK_HEADER = re.compile(r'^\s*Live ranges at \d+ \(peak\):')
_PEAK_LINE = re.compile(r'^\s+([\w.\-]+)(\{[\d,]*\})?: (\d+) bytes')
# An HLO instruction: `  [ROOT] %name = shape op(...), ..., metadata={op_name="..." ...}`.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\(')
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def dump_options(directory: str) -> dict:
  """Compiler options that write a program's memory reports (and nothing per pass) to
  `directory`."""
  return {'xla_dump_to': directory, 'xla_dump_hlo_pass_re': '^$'}


def _newest(directory: str, suffix: str) -> str | None:
  paths = glob.glob(os.path.join(directory, f'*{suffix}'))
  return max(paths, key=os.path.getmtime) if paths else None


def peak_buffers(directory: str) -> list[dict] | None:
  """The buffers live at the peak of the program last dumped to `directory` (largest first):
  name, bytes, shape, the HLO opcode that made it and its JAX op name; None without a dump."""
  live_range = _newest(directory, '-live-range.txt')
  if live_range is None:
    return None
  prefix = live_range[:-len('after_optimizations-live-range.txt')]
  instructions = {}
  with open(prefix + 'after_optimizations.txt') as f:
    for line in f:
      if m := _INSTRUCTION.match(line):
        op_name = _OP_NAME.search(line)
        instructions[m.group(1)] = (m.group(2), m.group(3), op_name.group(1) if op_name else '')
  buffers, in_peak = [], False
  with open(live_range) as f:
    for line in f:
      if _PEAK_HEADER.match(line):
        in_peak = True
        continue
      if in_peak:
        m = _PEAK_LINE.match(line)
        if not m:
          break
        shape, opcode, op_name = instructions.get(m.group(1), ('?', '?', ''))
        buffers.append({'name': m.group(1) + (m.group(2) or ''), 'bytes': int(m.group(3)),
                        'shape': _element(shape, m.group(2) or ''), 'opcode': opcode,
                        'op_name': op_name})
  return sorted(buffers, key=lambda b: -b['bytes'])


def _element(shape: str, index: str) -> str:
  """The shape of element `index` ('{2}', '{1,0}', or '') of a tuple shape."""
  for i in (int(i) for i in index.strip('{}').split(',') if i):
    if not shape.startswith('('):
      break
    parts, depth, start = [], 0, 1
    for j, c in enumerate(shape):
      depth += c in '([{'
      depth -= c in ')]}'
      if (c == ',' and depth == 1) or (c == ')' and depth == 0):
        parts.append(re.sub(r'/\*index=\d+\*/', '', shape[start:j]).strip())
        start = j + 1
    shape = parts[i] if i < len(parts) else '?'
  return shape


_UNITS = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30, 'TiB': 2**40}
# `   64.00GiB( 11%);   64.00GiB;      1376256;                6; f32[..], 5xf32[..]`
_CHUNK = re.compile(r'^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*\d+;\s*(.*)$')


def peak_chunks(directory: str) -> tuple[int, list[dict]] | None:
  """The default memory space's total bytes and its chunks (largest first: bytes and the
  shapes of the values in each) for the program last dumped to `directory`; None without a
  dump."""
  report = _newest(directory, '-memory-usage-report.txt')
  if report is None:
    return None
  chunks, total = [], None
  with open(report) as f:
    for line in f:
      if line.startswith('Memory Space:') and total is not None:
        break  # Past the default (HBM) space: vmem, smem follow.
      if line.startswith('Total bytes:'):
        total = int(line.split()[2])
      elif m := _CHUNK.match(line):
        chunks.append({'bytes': round(float(m.group(1)) * _UNITS[m.group(2)]),
                       'shapes': m.group(3).strip()})
  return total, sorted(chunks, key=lambda c: -c['bytes'])


def _without_layout(shape: str) -> str:
  return re.sub(r'\{[^}]*\}', '', shape)


def breakdown(directory: str, largest: int = 12) -> dict | None:
  """The memory layout's total bytes and its `largest` chunks: bytes, shapes, and the op name
  of a buffer live at the peak with one of the chunk's shapes (where the step made it)."""
  found = peak_chunks(directory)
  if found is None:
    return None
  total, chunks = found
  made_by = {}
  for b in peak_buffers(directory) or []:
    if b['op_name']:  # The largest named buffer of each shape.
      made_by.setdefault(_without_layout(b['shape']), b['op_name'])
  rows = []
  for chunk in chunks[:largest]:
    # '5xf32[2,16]' -> 'f32[2,16]'; shapes list their dimensions with commas too.
    shapes = [re.sub(r'^\d+\u00d7', '', s) for s in re.findall(r'[^\s,][^\]]*\]', chunk['shapes'])]
    rows.append({**chunk, 'op_name': next((made_by[s] for s in shapes if s in made_by), '')})
  return {'total_bytes': total, 'chunks': rows}
