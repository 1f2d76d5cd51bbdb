"""engine.sweep's results: each variant's numbers read from its workdir (metrics.jsonl, and
summary.json where the run wrote one), one table (DIR/sweep.md, DIR/sweep.csv) and one plot of
every loss curve (DIR/loss_curves.png)."""

from __future__ import annotations

import csv
import json
import os

import matplotlib
from etils import epath

matplotlib.use('Agg')  # Files only; no display on training machines.
import matplotlib.pyplot as plt  # noqa: E402

from engine.workdir import summary as run_summary  # noqa: E402

COLUMNS = ('variant', 'status', 'final eval loss', 'best eval loss', 'tokens/s', 'MFU',
           'peak memory MiB')


def read_metrics(workdir: str) -> list[dict]:
  return run_summary.read_records(epath.Path(workdir) / 'metrics.jsonl')


def _summary(workdir: str) -> dict:
  try:
    with open(os.path.join(workdir, 'summary.json')) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}


def results(workdir: str, status: str) -> dict:
  """One row: final and best eval loss, median tokens/s and MFU (from metrics.jsonl, as the
  run's summary.json has them), peak memory (from summary.json, when the run wrote one); None
  where there is no number."""
  figures = run_summary.figures(read_metrics(workdir))
  peak = _summary(workdir).get('peak_memory_bytes')
  return {'status': status, 'final_eval_loss': figures['final_eval_loss'],
          'best_eval_loss': figures['best_eval_loss'], 'tokens_per_s': figures['tokens_per_s'],
          'mfu': figures['mfu'],
          'peak_memory_mib': peak / 2**20 if isinstance(peak, (int, float)) else None}


def _cells(name: str, row: dict) -> list[str]:
  def number(value, spec):
    return '-' if value is None else format(value, spec)
  return [name, row['status'], number(row['final_eval_loss'], '.4f'),
          number(row['best_eval_loss'], '.4f'), number(row['tokens_per_s'], ',.0f'),
          number(row['mfu'], '.1%'), number(row['peak_memory_mib'], '.1f')]


def markdown(rows: dict[str, dict]) -> str:
  lines = ['| ' + ' | '.join(COLUMNS) + ' |', '|' + '---|' * len(COLUMNS)]
  lines += ['| ' + ' | '.join(_cells(name, row)) + ' |' for name, row in rows.items()]
  return '\n'.join(lines) + '\n'


def write_csv(path: str, rows: dict[str, dict]) -> None:
  keys = ('status', 'final_eval_loss', 'best_eval_loss', 'tokens_per_s', 'mfu',
          'peak_memory_mib')
  with open(path, 'w', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(('variant', *keys))
    for name, row in rows.items():
      writer.writerow((name, *('' if row[k] is None else row[k] for k in keys)))


def plot(path: str, workdirs: dict[str, str]) -> None:
  """Every variant's train loss as a line, its eval losses as points of the same colour."""
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


def write_all(directory: str, rows: dict[str, dict], workdirs: dict[str, str]) -> str:
  """sweep.md, sweep.csv and loss_curves.png in `directory`; returns the Markdown table."""
  table = markdown(rows)
  with open(os.path.join(directory, 'sweep.md'), 'w') as f:
    f.write(table)
  write_csv(os.path.join(directory, 'sweep.csv'), rows)
  plot(os.path.join(directory, 'loss_curves.png'), workdirs)
  return table
