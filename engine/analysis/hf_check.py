"""The engine's Hugging Face Llama-family support checked against transformers itself.

  python -m engine.analysis.hf_check --torch_python=/path/to/python-with-torch \
      [--families=llama2,llama3,mistral,qwen2,qwen3,mixtral,qwen3_moe] [--formats=v5,legacy] \
      [--modes=auto,manual] [--mesh=2x2x2] [--out=/tmp/hf_check] [--dir=KEEP_FILES_HERE]

For every family and config format, a child process run by --torch_python (a Python with torch
and transformers >= 5; engine/analysis/hf_reference.py, so this process never imports torch)
builds a tiny random model of the family with transformers, saves it with save_pretrained (in
transformers 5's `rope_parameters` config format, "v5", or rewritten into the older top-level
`rope_theta` / `rope_scaling` one, "legacy"), and writes transformers' logits on fixed token ids
(the models: hf_reference.py's docstring; Llama 3 rotary, Qwen2 biases, Qwen3 q/k norms, head_dim
and a tied head, Mixtral's and Qwen3-MoE's experts (the engine's dropless dispatch), every norm
and bias random). Then, in each mode, this process:

  1. loads the directory as `train.init_from=hf:DIR` does (engine.assemble, engine.hf.load.load_params)
     on a DATAxFSDPxTENSOR mesh (default 2x2x2: 8 devices; run directly, this command asks XLA
     for 8 CPU devices itself when XLA_FLAGS does not say);
  2. compares, through each mode's own compiled code: auto, the logits of the auto forward pass
     (as engine.evaluate computes them) against transformers'; both modes, the eval step's mean
     next-token loss, and the loss of one train step, against the cross-entropy of transformers'
     logits (computed here in float64);
  3. takes that one optimizer step, exports the trained parameters with engine.hf.save.save, has
     transformers load the export (AutoModelForCausalLM.from_pretrained) and compute its
     logits, and compares them with the engine's logits of the trained parameters (the auto
     forward pass, for both modes' steps) and the mode's eval loss with their cross-entropy;
     whatever transformers says while loading (its logger's warnings, Python warnings) is
     recorded.

Prints a Markdown table (family | config format | mode | logits | loss | export | load
warnings | verdict) and, with --out, writes OUT.md and OUT.json. A row PASSes when every
difference is float32 noise (the tolerances in hf_compare.py) and transformers loaded the export
without a warning: a missing or unexpected tensor, or a config key transformers does not read the
same way, is what this check is for. A family the engine refuses (a ConfigError: a key it does
not compute) is reported as `refused: <why>`, not failed. Exit status 1 if any row FAILs or errs.

This module is the command (its flags, the child process, the report); hf_compare.py is the
engine's side of each comparison (steps 1 to 3, the tolerances and the verdict).

tests/test_hf_check.py runs both without torch, a NumPy Llama standing in for transformers.
"""

from __future__ import annotations

import os
import sys

if __name__ == '__main__' and 'jax' not in sys.modules and (
    'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', '')):
  # Before JAX starts: the default 2x2x2 mesh needs 8 devices; on a CPU, simulated ones.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

# pylint: disable=wrong-import-position
import json
import shutil
import subprocess
import tempfile

import jax
import numpy as np
from absl import flags, logging

from engine import config as config_lib
from engine import parallel
from engine.analysis.hf_compare import (LOGITS_RTOL, LOSS_RTOL, ROWS, SEED, SEQ_LEN, check,
                                        engine_config, make_tokens, mesh_devices, not_checked)
from engine.cli.command_line import run_command
from engine.errors import ConfigError

FAMILIES = ('llama2', 'llama3', 'mistral', 'qwen2', 'qwen3', 'mixtral', 'qwen3_moe')
FORMATS = ('v5', 'legacy')
REFERENCE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hf_reference.py')


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


def main():
  """The command: flags defined here, not at import, so that importing this module (the tests)
  defines no flag another command also has."""
  torch_python = flags.DEFINE_string('torch_python', None, 'A Python with torch and '
                                     'transformers >= 5, e.g. ENV/bin/python.')
  families = flags.DEFINE_list('families', list(FAMILIES), 'Model families to check.')
  formats = flags.DEFINE_list('formats', list(FORMATS), 'config.json formats: v5 '
                              '(rope_parameters), legacy (rope_theta, rope_scaling).')
  modes = flags.DEFINE_list('modes', ['auto', 'manual'], 'Parallelism modes.')
  mesh = flags.DEFINE_string('mesh', '2x2x2', f'Mesh {config_lib.MESH_FORMAT}.')
  out = flags.DEFINE_string('out', None, 'Write OUT.md and OUT.json.')
  keep = flags.DEFINE_string('dir', None, 'Keep the checkpoints, logits and exports here '
                             '(default: a temporary directory, removed at the end).')

  def run(argv):
    del argv
    rows, report, versions, made = check_all(
        torch_python.value, chosen(families.value, FAMILIES, '--families'),
        chosen(formats.value, FORMATS, '--formats'),
        chosen(modes.value, tuple(sorted(parallel.STEP_BUILDERS)), '--modes'), mesh.value,
        keep.value)
    print(report)
    if out.value:
      os.makedirs(os.path.dirname(os.path.abspath(out.value)), exist_ok=True)
      with open(out.value + '.md', 'w') as f:
        f.write(report + '\n')
      with open(out.value + '.json', 'w') as f:
        json.dump({'title': report.splitlines()[0][3:], 'versions': versions, 'rows': rows,
                   'checkpoints': made,
                   'tolerance': {'logits_rtol': LOGITS_RTOL, 'loss_rtol': LOSS_RTOL}}, f,
                  indent=1)
      logging.info('Wrote %s.md and %s.json', out.value, out.value)
    if any(row['verdict'] in ('FAIL', 'ERROR') for row in rows):
      sys.exit(1)

  run_command(run, 'engine.analysis.hf_check', required=('torch_python',))


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


if __name__ == '__main__':
  main()
