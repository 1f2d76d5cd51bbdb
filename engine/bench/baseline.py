"""`python -m engine.bench --baseline=DIR`: the same variants built by another checkout of the
engine (DIR, e.g. `git worktree add --detach /tmp/before HEAD` made before a change), timed in
the same interleaved rounds as this tree's, so that machine noise hits both alike.

DIR's steps run in a child process (engine/bench/baseline_child.py, whose docstring gives
the protocol) that imports DIR's engine and takes a turn in every round, like the PyTorch
reference. Its variants become rows `MODE (baseline)` of the bench's table, and `comparison`
sets each beside this tree's: median step times, their ratio, and the largest difference of
their losses (zero when nothing numeric changed: same config, data and initial parameters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import NoReturn

import numpy as np

from engine.analysis import collectives
from engine.analysis.benchmark import ModeRun, child_failed
from engine.errors import ConfigError
from engine.runtime.progress import phase

SUFFIX = ' (baseline)'  # After the mode, in its rows.


def check_baseline(directory: str) -> None:
  """DIR must be the root of a checkout (DIR/engine/__init__.py), before anything compiles."""
  init = os.path.join(directory, 'engine', '__init__.py')
  if not directory or not os.path.isfile(init):  # '' would quietly mean the current directory.
    raise ConfigError(f'--baseline={directory} is not a checkout of the engine (no {init}); give '
                      'the root of one, e.g. a git worktree: git worktree add --detach '
                      '/tmp/before HEAD')


class BaselineReference:
  """The child that runs DIR's variants (every mesh, then every mode, as the bench orders this
  tree's); `self(timed)` runs one step of each on the round's batch."""

  def __init__(self, directory: str, config_json: str, meshes: list[str], modes: list[str]):
    self.directory = os.path.abspath(directory)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'baseline_child.py')
    env = dict(os.environ, PYTHONPATH=self.directory)  # XLA_FLAGS, JAX_PLATFORMS: inherited.
    self.command = f'PYTHONPATH={self.directory} {sys.executable} {script} (in {self.directory})'
    self.stderr = tempfile.TemporaryFile()  # A pipe nobody reads could fill and stall it.
    self.process = subprocess.Popen([sys.executable, script], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                    cwd=self.directory, env=env)
    self._send(json.dumps({'config': config_json, 'meshes': meshes, 'modes': modes}),
               'did not start')
    with phase(f"the baseline's variants (a child process, in {self.directory})"):
      line = self.process.stdout.readline()  # Its 'ready' comes once they are compiled.
    if not line.startswith('ready '):
      self._failed('did not start')
    self.variants = json.loads(line[len('ready '):])['variants']
    self.step_ms = [[] for _ in self.variants]
    self.losses = [[] for _ in self.variants]

  def _send(self, line: str, failure: str = 'stopped') -> None:
    try:
      self.process.stdin.write(line + '\n')
      self.process.stdin.flush()
    except BrokenPipeError:
      self._failed(failure)

  def _failed(self, what: str) -> NoReturn:
    child_failed(self.process, self.stderr, f'the baseline ({self.directory}) {what}',
                 self.command)

  def __call__(self, timed: bool) -> None:
    self._send('step')
    line = self.process.stdout.readline()
    if not line:
      self._failed('stopped')
    reply = json.loads(line)
    for k, (ms, loss) in enumerate(zip(reply['step_ms'], reply['loss'])):
      self.losses[k].append(loss)  # Warm-up included, as this tree's runs record them.
      if timed:
        self.step_ms[k].append(ms)

  def close(self, setups: list) -> list[ModeRun]:
    """Ends the child; its variants as ModeRuns (on `setups`, this tree's setup of each mesh,
    for the mesh and the collectives' axes), ready for benchmark.measurements."""
    self._send('quit')
    self.process.wait(timeout=60)
    self.stderr.close()
    runs = []
    for k, v in enumerate(self.variants):
      setup = setups[v['mesh_index']]
      runs.append(ModeRun(v['mode'] + SUFFIX, setup, None, v['compile_s'], v['memory'],
                          collectives.count_collectives(v['hlo'], setup.mesh),
                          [ms / 1e3 for ms in self.step_ms[k]], self.losses[k]))
    return runs


def interleave(rows: list[dict], baseline_rows: list[dict]) -> list[dict]:
  """This tree's rows with the baseline's after them on each mesh (a mesh's rows together)."""
  out = []
  for mesh in dict.fromkeys(r['mesh'] for r in rows):
    out += [r for r in rows if r['mesh'] == mesh and not r.get('dense_equivalent')]
    out += [r for r in baseline_rows if r['mesh'] == mesh]
  return out + [r for r in rows if r.get('dense_equivalent')]


def comparison(rows: list[dict]) -> list[dict]:
  """Per (mesh, mode): this tree's and the baseline's median ms, their ratio, and the largest
  absolute difference of their losses, step by step."""
  ours = {(r['mesh'], r['mode']): r for r in rows
          if not r.get('baseline') and not r.get('dense_equivalent')}
  out = []
  for r in rows:
    if r.get('baseline') and (mine := ours.get((r['mesh'], r['mode'][:-len(SUFFIX)]))):
      out.append({'mesh': r['mesh'], 'mode': mine['mode'], 'median_ms': mine['median_ms'],
                  'baseline_median_ms': r['median_ms'],
                  'ratio': mine['median_ms'] / r['median_ms'],
                  'max_loss_difference': float(np.max(np.abs(
                      np.array(mine['losses']) - np.array(r['losses']))))})
  return out


def comparison_markdown(pairs: list[dict], directory: str) -> str:
  lines = [f'This tree / baseline ({directory}), interleaved in the same rounds:', '',
           '| mesh | mode | this tree ms | baseline ms | this tree / baseline | '
           'max abs loss difference |', '|---|---|---:|---:|---:|---:|']
  lines += [f'| {p["mesh"]} | {p["mode"]} | {p["median_ms"]:.1f} | '
            f'{p["baseline_median_ms"]:.1f} | {p["ratio"]:.3f} | '
            f'{p["max_loss_difference"]:.3g} |' for p in pairs]
  return '\n'.join(lines)
