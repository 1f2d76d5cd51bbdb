"""hf_check's runs: the transformers child process (hf_reference.py, run by a Python with torch),
every family x config format x mode checked through engine_side.py, and the Markdown report. The
command, its flags and what the check proves: engine/analysis/hf_check/__main__.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import jax
import numpy as np
from absl import logging

from engine import config as config_lib
from engine.analysis import references
from engine.analysis.hf_check.engine_side import (LOGITS_RTOL, LOSS_RTOL, ROWS, SEED, SEQ_LEN,
                                                  check, engine_config, make_tokens, mesh_devices,
                                                  not_checked)
from engine.errors import ConfigError

FAMILIES = ('llama2', 'llama3', 'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen3_moe',
            'deepseek_v3', 'gemma2', 'gemma3')
FORMATS = ('v5', 'legacy')
REFERENCE_SCRIPT = references.script('hf_reference.py')


class Transformers:
  """hf_reference.py in a child process run by a Python with torch and transformers."""

  def __init__(self, python: str, threads: int, stderr_path: str):
    self.stderr = open(stderr_path, 'w+')
    self.args = [python, REFERENCE_SCRIPT, '--threads', str(threads)]
    self.process = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=self.stderr, text=True)
    hello = self._reply()
    self.versions = {'torch': hello['torch'], 'transformers': hello['transformers']}

  def _reply(self) -> dict:
    line = self.process.stdout.readline()
    if not line:
      self.stderr.seek(0)
      said = self.stderr.read().strip().splitlines()
      raise RuntimeError(f'{" ".join(self.args)} stopped'
                         + (f': {said[-1]}' if said else '') + '; run it by hand to see why.')
    return json.loads(line)

  def ask(self, **request) -> dict:
    self.process.stdin.write(json.dumps(request) + '\n')
    self.process.stdin.flush()
    reply = self._reply()
    if 'error' in reply:
      raise RuntimeError(f'hf_reference.py {request["cmd"]}: {reply["error"]}')
    return reply

  def make(self, family: str, directory: str, formats, tokens_BL: np.ndarray) -> dict:
    return self.ask(cmd='make', family=family, dir=directory, formats=list(formats),
                    tokens=tokens_BL.tolist(), seed=SEED)

  def logits(self, directory: str, tokens_BL: np.ndarray) -> tuple[np.ndarray, list[str]]:
    reply = self.ask(cmd='logits', dir=directory, tokens=tokens_BL.tolist())
    return np.load(reply['logits']), reply['warnings']

  def close(self) -> None:
    if self.process.poll() is None:
      self.process.stdin.write(json.dumps({'cmd': 'quit'}) + '\n')
      self.process.stdin.flush()
      self.process.wait(timeout=60)
    self.stderr.close()


def check_torch_python(python: str) -> dict:
  """The versions of torch and transformers `python` imports; ConfigError if it cannot."""
  probe = ('import json, torch, transformers, safetensors; print(json.dumps({"torch": '
           'torch.__version__, "transformers": transformers.__version__}))')
  try:
    done = subprocess.run([python, '-c', probe], capture_output=True, text=True, timeout=300)
  except OSError as error:
    raise ConfigError(f'--torch_python={python}: cannot run it ({error.strerror}); pass a '
                      'Python that has torch and transformers >= 5.') from None
  if done.returncode != 0:
    said = done.stderr.strip().splitlines()
    raise ConfigError(f'--torch_python={python} cannot import torch, transformers and '
                      f'safetensors ({said[-1] if said else f"exit status {done.returncode}"}); '
                      'pass a Python that has them (transformers >= 5).')
  versions = json.loads(done.stdout.strip().splitlines()[-1])
  major = versions['transformers'].split('.')[0]
  if not major.isdigit() or int(major) < 5:
    raise ConfigError(f'--torch_python={python} has transformers {versions["transformers"]}; '
                      'the check needs transformers >= 5 (its save_pretrained writes the v5 '
                      'config format).')
  return versions


def chosen(values, known, flag: str) -> list[str]:
  """A list flag's values, each one of `known`; ConfigError naming the first that is not."""
  values = [v.strip() for v in values if v.strip()]
  if not values:
    raise ConfigError(f'{flag} is empty; choose one or more of {",".join(known)}.')
  for value in values:
    if value not in known:
      raise ConfigError(f'{flag}: {value!r} is unknown; choose from {",".join(known)}.')
  return values


def _num(value: float | None) -> str:
  return '—' if value is None else f'{value:.1e}'


def _warnings_cell(row: dict) -> str:
  said = row.get('load_warnings')
  if said is None:
    return '—'
  if not said:
    return 'none'
  first = ' '.join(said[0].split())
  first = first if len(first) <= 80 else first[:77] + '...'
  return f'{len(said)}: {first}'.replace('|', '\\|')


def markdown(rows: list[dict], title: str) -> str:
  lines = [f'## {title}', '',
           f'Tolerances: logits max |diff| <= {LOGITS_RTOL:g} x max(1, max |logit|); losses '
           f'|diff| <= {LOSS_RTOL:g} x max(1, loss); the export loads without a warning.', '',
           '| family | config format | mode | logits max \\|diff\\| vs transformers | loss '
           '\\|diff\\| (eval; train step) | exported: transformers logits vs engine | load '
           'warnings | verdict |',
           '|---|---|---|---|---|---|---|---|']
  for row in rows:
    if row['status'] != 'ok':
      status = ' '.join(row['status'].split()).replace('|', '\\|')
      lines.append(f'| {row["family"]} | {row["format"]} | {row["mode"]} | {status} | — | — | '
                   f'— | {row["verdict"]} |')
      continue
    logits = ('— (manual: no logits; loss checked)' if row['logits_max_diff'] is None else
              f'{_num(row["logits_max_diff"])} (of {row["logits_max_abs"]:.1f})')
    verdict = row['verdict'] + (f' ({", ".join(row["failed"])})' if row['failed'] else '')
    lines.append(
        f'| {row["family"]} | {row["format"]} | {row["mode"]} | {logits} | '
        f'{_num(row["eval_loss_diff"])}; {_num(row["train_loss_diff"])} | '
        f'{_num(row["export_logits_max_diff"])} (loss {_num(row["export_eval_loss_diff"])}) | '
        f'{_warnings_cell(row)} | {verdict} |')
  return '\n'.join(lines)


def run_checks(transformers: Transformers, families, formats, modes, mesh: str,
               directory: str) -> tuple[list[dict], dict]:
  """Every family x format x mode; returns the rows and what transformers said per family."""
  tokens = make_tokens()
  rows, made = [], {}
  for family in families:
    try:
      reply = transformers.make(family, os.path.join(directory, family), formats, tokens[:, :-1])
    except RuntimeError as error:
      rows += [not_checked(family, fmt, mode, f'error: {error}', 'ERROR')
               for fmt in formats for mode in modes]
      continue
    made[family] = reply
    for fmt in formats:
      path = reply['formats'][fmt]['dir']
      reference = np.load(os.path.join(path, 'reference_logits.npy'))
      for mode in modes:
        logging.info('%s, %s config, %s mode', family, fmt, mode)
        export_dir = os.path.join(directory, family, f'{fmt}_{mode}_export')
        try:
          row = check(family, fmt, path, mode, tokens, reference,
                      lambda d: transformers.logits(d, tokens[:, :-1]), export_dir, mesh)
        except Exception as error:  # pylint: disable=broad-except
          # One family's failure (the engine's or the child's) must not hide the others' rows.
          logging.exception('%s %s %s', family, fmt, mode)
          first = (str(error).strip().splitlines() or [''])[0]
          row = not_checked(family, fmt, mode, f'error: {type(error).__name__}: {first}',
                            'ERROR')
        row['reference_load_warnings'] = reply['formats'][fmt]['warnings']
        rows.append(row)
  return rows, made


def check_all(python: str, families, formats, modes, mesh: str, keep: str | None):
  """(rows, the Markdown report, torch / transformers versions, the child's replies); every
  input checked before anything runs."""
  config_lib.parse_mesh(mesh, '--mesh')
  mesh_devices(engine_config('', 'auto', mesh, ROWS, SEQ_LEN))
  versions = check_torch_python(python)
  directory = keep or tempfile.mkdtemp(prefix='hf_check_')
  os.makedirs(directory, exist_ok=True)
  transformers = Transformers(python, os.cpu_count() or 1,
                              os.path.join(directory, 'hf_reference.stderr'))
  try:
    rows, made = run_checks(transformers, families, formats, modes, mesh, directory)
  finally:
    transformers.close()
    if not keep:
      shutil.rmtree(directory, ignore_errors=True)
  title = (f'The engine against transformers {versions["transformers"]} (torch '
           f'{versions["torch"]}): tiny random float32 models, {ROWS} x {SEQ_LEN} tokens, mesh '
           f'{mesh} on {jax.device_count()} x {jax.devices()[0].device_kind}')
  return rows, markdown(rows, title), versions, made
