"""engine.sweep's results: each variant's numbers read from its workdir (metrics.jsonl, and
summary.json where the run wrote one), one table (DIR/sweep.md, DIR/sweep.csv) with the best
variant marked, one plot of every loss curve (DIR/loss_curves.png) and one of the final losses
against each swept value (DIR/final_loss.png)."""

from __future__ import annotations

import csv
import json
import os

from etils import epath

from engine.runtime.pyplot import pyplot
from engine.workdir import summary as run_summary

COLUMNS = ('variant', 'status', 'final train loss', 'final eval loss', 'best eval loss',
           'tokens/s', 'MFU', 'peak memory MiB')
CSV_KEYS = ('status', 'final_train_loss', 'final_eval_loss', 'best_eval_loss', 'tokens_per_s',
            'mfu', 'peak_memory_mib')
BEST_MARK = ' (best)'  # After the best variant's name in sweep.md.


def read_metrics(workdir: str) -> list[dict]:
  return run_summary.read_records(epath.Path(workdir) / 'metrics.jsonl')


def _summary(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, 'summary.json')) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}


def results(workdir: str, status: str) -> dict:
  """One row: final train loss, final and best eval loss, median tokens/s and MFU (from
  metrics.jsonl, as the run's summary.json has them), peak memory (from summary.json, when the
  run wrote one); None where there is no number."""
  figures = run_summary.figures(read_metrics(workdir))
  peak = _summary(workdir).get('peak_memory_bytes')
  return {'status': status, 'final_train_loss': figures['final_train_loss'],
          'final_eval_loss': figures['final_eval_loss'],
          'best_eval_loss': figures['best_eval_loss'], 'tokens_per_s': figures['tokens_per_s'],
          'mfu': figures['mfu'],
          'peak_memory_mib': peak / 2**20 if isinstance(peak, (int, float)) else None}


def ranking_key(rows: dict[str, dict]) -> str | None:
  """The loss that ranks the variants: the final eval loss where every finished variant has one,
  else the final train loss where they all have that; None if neither (or nothing finished)."""
  finished = [row for row in rows.values() if row['status'] == 'finished']
  for key in ('final_eval_loss', 'final_train_loss'):
    if finished and all(row[key] is not None for row in finished):
      return key
  return None


def best_variant(rows: dict[str, dict]) -> str | None:
  """The finished variant with the lowest ranking_key loss (the first of equals); None if none."""
  key = ranking_key(rows)
  if key is None:
    return None
  finished = {name: row for name, row in rows.items() if row['status'] == 'finished'}
  return min(finished, key=lambda name: finished[name][key])


def _cells(name: str, row: dict) -> list[str]:
  def number(value, spec):
    return '-' if value is None else format(value, spec)
  return [name, row['status'], number(row['final_train_loss'], '.4f'),
          number(row['final_eval_loss'], '.4f'), number(row['best_eval_loss'], '.4f'),
          number(row['tokens_per_s'], ',.0f'), number(row['mfu'], '.1%'),
          number(row['peak_memory_mib'], '.1f')]


def markdown(rows: dict[str, dict]) -> str:
  """The table, the best variant's name marked, and a line saying which it is and why."""
  best = best_variant(rows)
  lines = ['| ' + ' | '.join(COLUMNS) + ' |', '|' + '---|' * len(COLUMNS)]
  lines += ['| ' + ' | '.join(_cells(name + (BEST_MARK if name == best else ''), row)) + ' |'
            for name, row in rows.items()]
  if best is not None:
    key, count = ranking_key(rows), sum(row['status'] == 'finished' for row in rows.values())
    lines += ['', f'Best: {best}, the lowest {key.replace("_", " ")} ({rows[best][key]:.4f}) of '
                  f'{count} finished variant{"s" if count > 1 else ""}.']
  return '\n'.join(lines) + '\n'


def write_csv(path: str, rows: dict[str, dict]) -> None:
  best = best_variant(rows)
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(('variant', *CSV_KEYS, 'best'))
    for name, row in rows.items():
      writer.writerow((name, *('' if row[k] is None else row[k] for k in CSV_KEYS),
                       int(name == best)))


def plot(path: str, workdirs: dict[str, str]) -> None:
  """Every variant's train loss as a line, its eval losses as points of the same colour."""
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(9, 5))
  # Layouts that agree (auto and manual, one mesh and another) draw the same curve: the line
  # styles keep every one of them visible.
  styles = ('-', '--', ':', '-.')
  for i, (name, workdir) in enumerate(workdirs.items()):
    records = read_metrics(workdir)
    train = [(r['step'], r['train/loss']) for r in records if 'train/loss' in r]
    evals = [(r['step'], r['eval/loss']) for r in records if 'eval/loss' in r]
    if not train and not evals:
      continue
    style = styles[i % len(styles)]
    line, = (ax.plot(*zip(*train), style, label=name) if train
             else ax.plot([], [], style, label=name))
    if evals:
      ax.plot(*zip(*evals), 'o', color=line.get_color())
  ax.set_xlabel('step')
  ax.set_ylabel('loss (line: train, points: eval)')
  ax.legend(fontsize='small')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def final_loss_series(rows: dict[str, dict], values: dict[str, tuple[tuple[str, str], ...]]
                      ) -> dict[str, dict[str, dict[str, list[tuple[str, float]]]]]:
  """For each swept key, for each combination of the other keys' values (its label, 'all' if
  there are none), the final 'eval' and 'train' losses as (value, loss) in the grid's order;
  variants without that loss are left out."""
  keys = list(dict(next(iter(values.values()))))
  series = {}
  for key in keys:
    lines = series.setdefault(key, {})
    for name, pairs in values.items():
      label = ', '.join(f'{k}={v}' for k, v in pairs if k != key) or 'all'
      line = lines.setdefault(label, {'eval': [], 'train': []})
      for kind in line:
        loss = rows[name][f'final_{kind}_loss']
        if loss is not None:
          line[kind].append((dict(pairs)[key], loss))
  return series


def _as_numbers(values: list[str]) -> list[float] | None:
  try:
    return [float(v) for v in values]
  except ValueError:
    return None


def plot_final_losses(path: str, rows: dict[str, dict],
                      values: dict[str, tuple[tuple[str, str], ...]]) -> None:
  """One panel per swept key: final_loss_series's lines, eval solid with points, train dashed,
  one colour per combination of the other keys; ticks at the swept values, numbers on a log axis
  when they span a factor of 10 or more, other values (mode, mesh) in the grid's order."""
  plt = pyplot()
  series = final_loss_series(rows, values)
  fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4), squeeze=False)
  for ax, (key, lines) in zip(axes[0], series.items()):
    order = list(dict.fromkeys(dict(pairs)[key] for pairs in values.values()))
    numbers = _as_numbers(order)
    x_of = dict(zip(order, numbers if numbers else range(len(order))))
    for i, (label, line) in enumerate(lines.items()):
      for kind, style in (('eval', 'o-'), ('train', 'x--')):
        if line[kind]:
          ax.plot([x_of[v] for v, _ in line[kind]], [loss for _, loss in line[kind]], style,
                  color=f'C{i % 10}', label=f'{label} ({kind})')
    if numbers and min(numbers) > 0 and max(numbers) >= 10 * min(numbers):
      ax.set_xscale('log')
    ax.set_xticks(list(x_of.values()), order)  # The swept values, as the grid wrote them.
    ax.minorticks_off()
    ax.set_xlabel(key)
    ax.set_ylabel('final loss (solid: eval, dashed: train)')
    if ax.lines:
      ax.legend(fontsize='small')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_all(directory: str, rows: dict[str, dict], workdirs: dict[str, str],
              values: dict[str, tuple[tuple[str, str], ...]]) -> str:
  """sweep.md, sweep.csv, loss_curves.png and final_loss.png in `directory` (`values`: each
  variant's (grid key, value) pairs); returns the Markdown table."""
  table = markdown(rows)
  with open(os.path.join(directory, 'sweep.md'), 'w') as f:
    f.write(table)
  write_csv(os.path.join(directory, 'sweep.csv'), rows)
  plot(os.path.join(directory, 'loss_curves.png'), workdirs)
  plot_final_losses(os.path.join(directory, 'final_loss.png'), rows, values)
  return table
