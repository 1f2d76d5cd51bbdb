"""What a run adds to its metrics and leaves behind at its end: MFU's peak, the peak device
memory, WORKDIR/summary.json and WORKDIR/loss_curve.png.

The summary and the curve are read back from metrics.jsonl, so that a resumed run's cover the
steps of its earlier attempts too.
"""

from __future__ import annotations

import io
import json
import math

import jax
import numpy as np
from absl import logging
from etils import epath

from engine import chips
from engine import config as config_lib
from engine.runtime.pyplot import pyplot
from engine.workdir import run_dir as workdir_lib

# The keys of summary.json (engine's sweep tools read them).
SUMMARY_KEYS = ('status', 'final_step', 'num_steps', 'final_train_loss', 'final_eval_loss',
                'best_eval_loss', 'best_eval_step', 'eval_perplexity', 'tokens_per_s', 'mfu',
                'peak_memory_bytes', 'peak_memory_source', 'wall_s', 'mode', 'mesh', 'model',
                'goodput', 'badput_s', 'attempts', 'compilation')


def peak_flops_of_devices(device_kind: str, dtype: str, num_devices: int) -> float | None:
  """The peak FLOP/s of `num_devices` chips of `device_kind` in `dtype`, None where unknown
  (CPUs, chips not in engine/chips.py)."""
  peak = chips.peak_flops(device_kind, dtype)
  return peak * num_devices if peak else None


def mfu(model_flops_per_s: float, peak_flops: float | None) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak (None: unknown)."""
  return model_flops_per_s / peak_flops if peak_flops else None


class PeakMemory:
  """The peak memory of this process's first device: the backend's own count where it keeps one
  (GPU, TPU), else the compiled train step's estimate (CPU)."""

  def __init__(self, estimate_bytes: int | None):
    self.estimate_bytes = estimate_bytes

  def read(self) -> tuple[int | None, str]:
    """(bytes, 'device' | 'compiled estimate')."""
    try:
      stats = jax.local_devices()[0].memory_stats()
    except Exception:  # Backends without memory stats may raise rather than return None.
      stats = None
    if stats and 'peak_bytes_in_use' in stats:
      return int(stats['peak_bytes_in_use']), 'device'
    return self.estimate_bytes, 'compiled estimate'


def mesh_string(shape: dict[str, int]) -> str:
  """A mesh's sizes as the flags take them: '2x2x2', context, stage and expert only where
  not 1."""
  return config_lib.format_mesh(shape)


def read_records(path: epath.Path) -> list[dict]:
  """metrics.jsonl's records (none if missing); a line cut short by a crash is skipped."""
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def _series(records: list[dict], name: str) -> tuple[list[int], list[float]]:
  pairs = [(r['step'], r[name]) for r in records if name in r]
  return [p[0] for p in pairs], [p[1] for p in pairs]


def _median(values: list[float]) -> float | None:
  values = [v for v in values if v is not None and math.isfinite(v)]
  return float(np.median(values)) if values else None


def figures(records: list[dict]) -> dict:
  """The losses and speed of metrics.jsonl's records (None where there is no number): what
  summary.json and engine.sweep's table report."""
  _, train_losses = _series(records, 'train/loss')
  eval_steps, eval_losses = _series(records, 'eval/loss')
  _, perplexities = _series(records, 'eval/perplexity')
  best = int(np.argmin(eval_losses)) if eval_losses else None
  return {
      'final_train_loss': train_losses[-1] if train_losses else None,
      'final_eval_loss': eval_losses[-1] if eval_losses else None,
      'best_eval_loss': eval_losses[best] if best is not None else None,
      'best_eval_step': eval_steps[best] if best is not None else None,
      'eval_perplexity': perplexities[-1] if perplexities else None,
      'tokens_per_s': _median(_series(records, 'train/tokens_per_s')[1]),
      'mfu': _median(_series(records, 'train/mfu')[1])}


def summarize(records: list[dict], *, status: str, final_step: int, num_steps: int,
              peak_memory: tuple[int | None, str], wall_s: float, mode: str, mesh: str,
              model: str, goodput: dict | None = None, compilation: dict | None = None) -> dict:
  """summary.json's contents from metrics.jsonl's records and the run's facts (`goodput`:
  engine/train/goodput.py's account of all attempts; `compilation`: this attempt's programs,
  engine/runtime/compile_cache.py)."""
  goodput = goodput or {}
  return {
      'status': status, 'final_step': final_step, 'num_steps': num_steps, **figures(records),
      'peak_memory_bytes': peak_memory[0], 'peak_memory_source': peak_memory[1],
      'wall_s': wall_s, 'mode': mode, 'mesh': mesh, 'model': model,
      'goodput': goodput.get('goodput'), 'badput_s': goodput.get('badput_s'),
      'attempts': goodput.get('attempts'), 'compilation': compilation}


def plot_loss_curve(records: list[dict], path: epath.Path) -> None:
  """Train and eval loss against step, as a PNG."""
  plt = pyplot()
  figure, axes = plt.subplots(figsize=(7, 4))
  for name, style in (('train/loss', '-'), ('eval/loss', 'o-')):
    steps, values = _series(records, name)
    if steps:
      axes.plot(steps, values, style, label=name.replace('/', ' '))
  axes.set_xlabel('step')
  axes.set_ylabel('loss')
  axes.grid(alpha=0.3)
  axes.legend()
  figure.tight_layout()
  buffer = io.BytesIO()
  figure.savefig(buffer, format='png', dpi=100)
  plt.close(figure)
  path.write_bytes(buffer.getvalue())


def write(workdir: epath.Path, **facts) -> dict | None:
  """Process 0 writes WORKDIR/summary.json (atomically) and WORKDIR/loss_curve.png from
  metrics.jsonl (closed first) and `facts` (summarize's), and returns the summary; the other
  processes write and return nothing."""
  if jax.process_index() != 0:
    return None
  records = read_records(workdir / 'metrics.jsonl')
  summary = summarize(records, **facts)
  summary_path, curve_path = workdir / 'summary.json', workdir / 'loss_curve.png'
  workdir_lib.write_text_atomically(summary_path, json.dumps(summary, indent=2) + '\n')
  plot_loss_curve(records, curve_path)
  logging.info('Run summary in %s, loss curve in %s', summary_path, curve_path)
  return summary
