"""Where a traced step's time went, op by op: per-op totals of a jax.profiler trace.

`engine.bench --profile=DIR` traces a few steps of each variant; `op_totals` reads one trace
(its *.xplane.pb, through jax.profiler.ProfileData) and sums each op's self time (its duration
less that of the events nested in it) over the lines that run device work, per traced step: on
XLA:CPU the threads of the simulated devices (Eigen's pool and the PjRt client's), on a GPU or
TPU the device planes' lines. Numbered instances of one op (`fusion.12`, `fusion.13`) count as
one name. On simulated CPU devices the threads share the machine's cores, so the sums exceed
the step's wall time: compare ops and variants with each other, not with the step time.

`split` sorts the names into compute, collectives and waiting (the runtime's rendezvous and
completion waits, where a device idles until the others arrive).
"""

from __future__ import annotations

import collections
import glob
import os
import re

import jax

# The lines that run device work: the simulated CPU devices' threads, or a device plane's.
_CPU_THREADS = re.compile(r'XLAEigen|XLAPjRtCpuClient')
_COLLECTIVE = re.compile(r'all.gather|all.reduce|reduce.scatter|psum|collective.permute|'
                         r'all.to.all|ppermute', re.IGNORECASE)
_WAITING = re.compile(r'Wait|Rendezvous|rendezvous|ThunkExecutor|Await|^end: ')


def trace_file(directory: str) -> str | None:
  """The newest *.xplane.pb under a trace directory (DIR/plugins/profile/<run>/), or None."""
  files = glob.glob(os.path.join(directory, 'plugins', 'profile', '*', '*.xplane.pb'))
  return max(files, key=os.path.getmtime) if files else None


def op_totals(path: str, steps: int) -> dict[str, float]:
  """{op name: self seconds per step, summed over the device lines} of one trace file."""
  data = jax.profiler.ProfileData.from_file(path)
  totals = collections.Counter()
  for plane in data.planes:
    device_plane = plane.name.startswith('/device:')
    for line in plane.lines:
      if device_plane or _CPU_THREADS.search(line.name):
        _add_self_times(line.events, totals)
  return {name: ns / 1e9 / steps for name, ns in totals.most_common()}


def _add_self_times(events, totals: collections.Counter) -> None:
  """Each event's duration less its nested events', added to totals[name without .N]."""
  stack = []  # [end, name, nested time, start] of the open events, innermost last.

  def close():
    end, name, nested, start = stack.pop()
    totals[re.sub(r'\.\d+$', '', name)] += end - start - nested
    if stack:
      stack[-1][2] += end - start

  for start, end, name in sorted((e.start_ns, e.start_ns + e.duration_ns, e.name)
                                 for e in events):
    while stack and stack[-1][0] <= start:
      close()
    stack.append([end, name, 0, start])
  while stack:
    close()


def kind(name: str) -> str:
  if _COLLECTIVE.search(name):
    return 'collectives'
  return 'waiting' if _WAITING.search(name) else 'compute'


def split(totals: dict[str, float]) -> dict[str, float]:
  """{'compute', 'collectives', 'waiting': seconds per step}."""
  sums = dict.fromkeys(('compute', 'collectives', 'waiting'), 0.0)
  for name, seconds in totals.items():
    sums[kind(name)] += seconds
  return sums


def markdown(variants: list[tuple[str, dict[str, float]]], top: int = 8) -> str:
  """Per variant (label, op_totals): compute / collectives / waiting, and its top ops other
  than waiting, in ms per step summed over the device threads."""
  lines = ['| variant | compute ms | collectives ms | waiting ms | top ops (ms) |',
           '|---|---:|---:|---:|---|']
  for label, totals in variants:
    sums = split(totals)
    ops = [(n, s) for n, s in totals.items() if kind(n) != 'waiting'][:top]
    lines.append(f'| {label} | {1e3 * sums["compute"]:.1f} | {1e3 * sums["collectives"]:.1f} | '
                 f'{1e3 * sums["waiting"]:.1f} | '
                 + ', '.join(f'{n} {1e3 * s:.1f}' for n, s in ops) + ' |')
  return '\n'.join(lines)
