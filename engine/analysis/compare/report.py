"""Renders a comparison (engine.analysis.compare) as Markdown, JSON and PNG plots in its workdir."""

from __future__ import annotations

import json
import os

import numpy as np

from engine.analysis import verdicts
from engine.parallel.pipeline.gpipe import SCHEDULE_NAMES, bubble_fraction
from engine.runtime.pyplot import pyplot

PLOTS = ('loss.png', 'step_time.png', 'communication.png')


def _mib(n: float) -> str:
  return f'{n / 2**20:.2f}'


def _table(header: list[str], rows: list[list]) -> list[str]:
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
  return lines


def _summary(report: dict) -> list[str]:
  """Title and setup line: what was compared, on which mesh, for how many steps."""
  return [f'# auto vs manual on mesh {report["mesh"]}', '',
          f'{report["steps"]} steps ({report["warmup"]} warm-up, {report["timed_steps"]} timed), '
          f'{report["tokens_per_step"]:,} tokens per step, compute dtype '
          f'{report.get("dtype", "float32")}, same seed, data and initial state.', '']


def _loss_table(report: dict) -> list[str]:
  """Per-step losses of each mode, against each other and the single-device reference (with
  grad norms) when there is one."""
  modes = report['modes']
  reference = report.get('reference_losses')
  header = ['step'] + [f'{m} loss' for m in modes]
  if reference:
    header += ['reference loss'] + [f'{m} - reference' for m in modes]
  if len(modes) == 2:
    header.append(f'{modes[1]} - {modes[0]}')
  if reference:
    header += ['reference grad norm'] + [f'{m} grad norm' for m in modes]
  rows = []
  for i in range(report['steps']):
    losses = [report['losses'][m][i] for m in modes]
    row = [i + 1] + [f'{l:.6f}' for l in losses]
    if reference:
      row += [f'{reference[i]:.6f}'] + [f'{l - reference[i]:+.2e}' for l in losses]
    if len(modes) == 2:
      row.append(f'{losses[1] - losses[0]:+.2e}')
    if reference:
      row += [f'{report["reference_grad_norms"][i]:.5f}'] + [
          f'{report["grad_norms"][m][i]:.5f}' for m in modes]
    rows.append(row)
  return _table(header, rows) + ['']


def _numerics(report: dict) -> list[str]:
  """## Numerics: the verdict, the loss table and the final parameters against the reference."""
  modes = report['modes']
  out = ['## Numerics', '']
  if 'verdict' in report:
    out += ['**Verdict**', '', *report['verdict'].splitlines(), '']
  out += _loss_table(report)
  if 'numerics' in report:
    out += [f'Parameters after step {report["steps"]} against the single-device reference '
            '(relative = max abs difference / max abs reference value):', '']
    paths = sorted(report['numerics'][modes[0]]['final_abs'])
    header = ['parameter'] + [f'{m} {k}' for m in modes for k in ('max abs', 'max rel')]
    rows = [[p] + [f'{report["numerics"][m][k][p]:.2e}' for m in modes
                   for k in ('final_abs', 'final_rel')] for p in paths]
    out += _table(header, rows) + ['']
  return out


def _speed(report: dict) -> list[str]:
  """## Speed: compile time and step-time statistics per mode, and their ratio."""
  out = ['## Speed', '']
  rows = []
  for m in report['modes']:
    s = report['speed'][m]
    rows.append([m, f'{s["compile_s"]:.1f}', f'{s["median_ms"]:.2f}', f'{s["min_ms"]:.2f}',
                 f'{s["max_ms"]:.2f}', f'{s["tokens_per_s"]:,.0f}'])
  out += _table(['mode', 'compile s', 'median ms', 'min ms', 'max ms', 'tokens/s'], rows)
  if 'ratio' in report['speed']:
    r = report['speed']['ratio']
    out += ['', f'Median step time ratio {r["of"]}: **{r["median"]:.3f}** (steps interleaved in '
            'one run).']
  return out + ['']


def _memory(report: dict) -> list[str]:
  """## Memory: the compiled train step's buffers per device, per mode."""
  rows = []
  for m in report['modes']:
    mem = report['memory'][m]
    rows.append([m] + [_mib(mem.get(k, 0)) for k in (
        'argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes',
        'alias_size_in_bytes', 'peak_estimate_bytes')])
  return ['## Memory per device (MiB, compiled train step)', ''] + _table(
      ['mode', 'arguments', 'outputs', 'temporaries', 'aliased', 'peak (args + '
       'outputs + temp - aliased)'], rows) + ['']


def _communication_table(report: dict) -> list[str]:
  """## Communication: each (kind, axes) row's count, bytes and ratio to theory per mode, with
  lower bounds marked."""
  modes = report['modes']
  out = ['## Communication per step and device', '',
         'Bytes are the results of each collective, summed over its executions (loop bodies once '
         'per layer); scalar reductions (loss, norms) are left out. Theory: see '
         'engine/analysis/comm_theory.py.', '']
  header = ['kind', 'mesh axes', 'theory KiB']
  for m in modes:
    header += [f'{m} count', f'{m} KiB', f'{m} types', f'{m} / theory']
  rows = []
  for row in report['communication']:
    cells = [row['kind'], row['axes'], f'{row["theory_bytes"] / 1024:.1f}']
    for m in modes:
      e = row[m]
      ratio = verdicts.lower_bound(e, f'{e["ratio"]:.2f}') if e['ratio'] is not None else (
          'unexpected' if e['unexpected'] else '-')
      if verdicts.is_off(e):
        ratio = f'**{ratio}**'
      cells += [verdicts.lower_bound(e, e['executions']) + (
                    " (a loop's trip count unknown)" if e.get('lower_bound') else ''),
                verdicts.lower_bound(e, f'{e["bytes"] / 1024:.1f}'), verdicts.element_types(e),
                ratio]
    rows.append(cells)
  return out + _table(header, rows) + ['']


def _schedule_note(report: dict) -> list[str]:
  """How micro-batches shape the communication: the pipeline's bubble, or the gradient syncs
  per step that a ratio near the micro-batch count betrays."""
  microbatches = report.get('microbatches', 1)
  stages = report['mesh'].get('stage', 1)
  if stages > 1:
    repeats = report.get('pipeline_repeats', 1)
    # Reports written before the key existed ran GPipe or circular.
    schedule = report.get('pipeline_schedule') or ('gpipe' if repeats == 1 else 'circular')
    name = SCHEDULE_NAMES[schedule] + (
        f' ({repeats} layer groups per stage)' if repeats > 1 else '')
    return [f'Pipeline: {stages} stages fed {microbatches} micro-batches on the {name} '
            'schedule; each stage idles '
            f'**{bubble_fraction(stages, microbatches, repeats, schedule):.3f}** of the step '
            '(the bubble the schedule implies: engine.parallel.pipeline.gpipe.bubble_fraction; '
            '`python -m engine.analysis.bubble` measures it from step times at several '
            'micro-batch counts). Micro-batches feed the pipeline here, not gradient '
            'accumulation.', '']
  if microbatches > 1:
    return [f'{microbatches} micro-batches per optimizer step. The theory synchronises each '
            'gradient once per step, as manual mode does (under FSDP it gathers every weight once '
            'per step); a measured / theory ratio near '
            f'{microbatches} on a gradient reduction means that mode synchronises once per '
            'micro-batch.', '']
  return []


def _grouped_query_note(report: dict) -> list[str]:
  """What grouped-query attention saves ring attention: it passes the N key / value heads, not
  their expansion to the H query heads."""
  heads = report.get('attention_heads') or {}
  if report['mesh'].get('context', 1) == 1 or heads.get('kv', 0) >= heads.get('query', 0):
    return []
  ring = sum(r['theory_bytes'] for r in report['communication']
             if r['kind'] == 'collective-permute' and 'context' in r['axes'])
  cut = heads['query'] / heads['kv']
  return [f'Grouped-query attention: ring attention passes the {heads["kv"]} key / value heads, '
          f'not their expansion to the {heads["query"]} query heads: {_mib(ring)} MiB of '
          f'permutes over `context` per step and device instead of {_mib(ring * cut)} '
          f'({cut:g}x less).', '']


def _communication(report: dict) -> list[str]:
  """The communication table and its notes: lower bounds and the schedule (the rows off their
  theory head the report: engine.analysis.verdicts)."""
  modes = report['modes']
  out = _communication_table(report)
  uncertain = [f'{m}: {r["kind"]} over {r["axes"]}' for r in report['communication']
               for m in modes if r[m].get('lower_bound')]
  if uncertain:
    out += [f'**Lower bounds** ({"; ".join(uncertain)}). {verdicts.LOWER_BOUND_NOTE}', '']
  return out + _schedule_note(report) + _grouped_query_note(report)


def markdown(report: dict) -> str:
  """The whole report as Markdown, one section after another, the plots last."""
  out = _summary(report)
  if 'off_theory' in report:  # First: a ratio far from 1 is the report's most telling line.
    out += verdicts.markdown([verdicts.Flag(**f) for f in report['off_theory']])
  out += _numerics(report) + _speed(report) + _memory(report)
  out += _communication(report)
  out += ['## Plots', ''] + [f'![{name}]({name})' for name in PLOTS]
  return '\n'.join(out) + '\n'


def plot(report: dict, workdir: str) -> None:
  plt = pyplot()
  modes = report['modes']
  steps = np.arange(1, report['steps'] + 1)

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
  for m in modes:
    top.plot(steps, report['losses'][m], marker='o', label=m)
  if report.get('reference_losses'):
    top.plot(steps, report['reference_losses'], 'k--', label='single device')
    for m in modes:
      bottom.plot(steps, np.array(report['losses'][m]) - report['reference_losses'],
                  marker='o', label=f'{m} - single device')
  elif len(modes) == 2:
    bottom.plot(steps, np.array(report['losses'][modes[1]]) - report['losses'][modes[0]],
                marker='o', label=f'{modes[1]} - {modes[0]}')
  top.set_ylabel('train loss')
  top.legend()
  bottom.set_ylabel('loss difference')
  bottom.set_xlabel('step')
  bottom.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'loss.png'), dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  ax.boxplot([report['speed'][m]['step_ms'] for m in modes])
  ax.set_xticks(range(1, len(modes) + 1), modes)
  ax.set_ylabel('step time (ms)')
  ax.set_title(f'{report["timed_steps"]} timed steps, interleaved')
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'step_time.png'), dpi=100)
  plt.close(fig)

  rows = report['communication']
  labels = [f'{r["kind"]}\n{r["axes"]}' for r in rows]
  series = [('theory', [r['theory_bytes'] / 1024 for r in rows])]
  series += [(m, [r[m]['bytes'] / 1024 for r in rows]) for m in modes]
  x = np.arange(len(rows))
  width = 0.8 / len(series)
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
  for i, (name, values) in enumerate(series):
    ax.bar(x + i * width, values, width, label=name)
  ax.set_xticks(x + width * (len(series) - 1) / 2, labels, fontsize=8)
  ax.set_ylabel('KiB per step per device')
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(workdir, 'communication.png'), dpi=100)
  plt.close(fig)


def write(workdir: str, report: dict) -> None:
  with open(os.path.join(workdir, 'report.json'), 'w') as f:
    json.dump(report, f, indent=1, default=str)
  with open(os.path.join(workdir, 'report.md'), 'w') as f:
    f.write(markdown(report))
  plot(report, workdir)
