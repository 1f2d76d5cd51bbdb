"""The engine's Hugging Face Llama-family support checked against transformers itself.

  python -m engine.analysis.hf_check --torch_python=/path/to/python-with-torch \
      [--families=llama2,llama3,mistral,qwen2,qwen3] [--formats=v5,legacy] \
      [--modes=auto,manual] [--mesh=2x2x2] [--out=/tmp/hf_check] [--dir=KEEP_FILES_HERE]

For every family and config format, a child process run by --torch_python (a Python with torch
and transformers >= 5; engine/analysis/hf_reference.py, so this process never imports torch)
builds a tiny random model of the family with transformers, saves it with save_pretrained (in
transformers 5's `rope_parameters` config format, "v5", or rewritten into the older top-level
`rope_theta` / `rope_scaling` one, "legacy"), and writes transformers' logits on fixed token ids
(the models: hf_reference.py's docstring; Llama 3 rotary, Qwen2 biases, Qwen3 q/k norms, head_dim
and a tied head, every norm and bias random). Then, in each mode, this process:

  1. loads the directory as `train.init_from=hf:DIR` does (engine.assemble, engine.hf.load_params)
     on a DATAxFSDPxTENSOR mesh (default 2x2x2: 8 devices; run directly, this command asks XLA
     for 8 CPU devices itself when XLA_FLAGS does not say);
  2. compares, through each mode's own compiled code: auto, the logits of the auto forward pass
     (as engine.evaluate computes them) against transformers'; both modes, the eval step's mean
     next-token loss, and the loss of one train step, against the cross-entropy of transformers'
     logits (computed here in float64);
  3. takes that one optimizer step, exports the trained parameters with engine.hf.save, has
     transformers load the export (AutoModelForCausalLM.from_pretrained) and compute its
     logits, and compares them with the engine's logits of the trained parameters (the auto
     forward pass, for both modes' steps) and the mode's eval loss with their cross-entropy;
     whatever transformers says while loading (its logger's warnings, Python warnings) is
     recorded.

Prints a Markdown table (family | config format | mode | logits | loss | export | load
warnings | verdict) and, with --out, writes OUT.md and OUT.json. A row PASSes when every
difference is float32 noise (the tolerances below) and transformers loaded the export without
a warning: a missing or unexpected tensor, or a config key transformers does not read the same
way, is what this check is for. A family the engine refuses (a ConfigError: a key it does not
compute) is reported as `refused: <why>`, not failed. Exit status 1 if any row FAILs or errs.

tests/test_hf_check.py runs this engine side without torch, a NumPy Llama standing in for
transformers.
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
import dataclasses
import inspect
import json
import math
import shutil
import subprocess
import tempfile
from collections.abc import Callable

import jax
import numpy as np
from absl import flags, logging
from flax import nnx

from engine import config as config_lib
from engine import hf, parallel
from engine.assemble import VOCABULARY, Run, assemble
from engine.cli import run_command
from engine.config import ConfigError
from engine.parallel.auto import AutoOps

FAMILIES = ('llama2', 'llama3', 'mistral', 'qwen2', 'qwen3')
FORMATS = ('v5', 'legacy')
REFERENCE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'hf_reference.py')

# Tolerances. Float32 sums taken in another order (sharded partial sums, other kernels) differ by
# a few ulps per operation. Measured against transformers 5.24 / torch 2.13 on the CPU, mesh
# 2x2x2: logits max |diff| 1.7e-6 to 2.5e-6 where |logits| <= 4.3, 1.9e-5 where they reach 67.5
# (Qwen3), i.e. <= 6e-7 of the largest logit; losses within 1e-6. A wrong rotary frequency, a
# dropped bias or norm, or a transposed head moves logits by 1e-2 or more (the llama3 model with
# default rotary instead: 0.9).
LOGITS_RTOL = 2e-5  # max |diff| <= LOGITS_RTOL * max(1, max |transformers' logit|)
LOSS_RTOL = 1e-5  # |diff| <= LOSS_RTOL * max(1, transformers' loss)

ROWS, SEQ_LEN, TOKEN_SEED, SEED = 4, 16, 1234, 0
LEARNING_RATE = 1e-2  # One step that moves every parameter visibly (warmup off).


def make_tokens(rows: int = ROWS, seq_len: int = SEQ_LEN, vocab: int = 256,
                seed: int = TOKEN_SEED) -> np.ndarray:
  """Fixed token windows [rows, seq_len + 1]: the inputs are [:, :-1], the targets [:, 1:]."""
  return np.random.default_rng(seed).integers(0, vocab, (rows, seq_len + 1)).astype(np.int32)


def next_token_loss(logits_BLV: np.ndarray, tokens_BL1: np.ndarray) -> float:
  """Mean cross-entropy of tokens[:, 1:] under logits of tokens[:, :-1], in float64."""
  logits = np.asarray(logits_BLV, np.float64)
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  picked = np.take_along_axis(logits, tokens_BL1[:, 1:, None].astype(np.int64), -1)[..., 0]
  return float((log_z - picked).mean())


def engine_config(path: str, mode: str, mesh: str, rows: int, seq_len: int):
  """What `train.init_from=hf:PATH` trains with: the Llama model, its settings from PATH's
  config.json (applied by assemble), one synthetic-data step of plain AdamW."""
  config = config_lib.default_config()
  config.model.name = 'llama'
  config.train.init_from = f'{hf.PREFIX}{path}'
  config.parallelism.mode = mode
  config_lib.set_mesh_shape(config, mesh, '--mesh')
  config.data.source = 'synthetic'
  config.data.seq_len = seq_len
  config.data.global_batch_size = rows
  config.train.num_steps = 1
  config.train.eval_batches = 1
  config.optim.warmup_steps = 0
  config.optim.learning_rate = config.optim.end_learning_rate = LEARNING_RATE
  config.seed = SEED
  return config


def mesh_devices(config) -> list:
  """The first devices the config's mesh needs (all of them for a -1 axis)."""
  sizes = [config.mesh[axis] for axis in config_lib.MESH_AXES]
  count = math.prod(size for size in sizes if size > 0)
  if -1 in sizes:
    return jax.devices()
  if count > jax.device_count():
    raise ConfigError(f'the mesh needs {count} devices, this process has {jax.device_count()}; '
                      'on a CPU run with XLA_FLAGS=--xla_force_host_platform_device_count='
                      f'{count} (without XLA_FLAGS this command asks for 8), or pass a smaller '
                      '--mesh.')
  return jax.devices()[:count]


def save_export(params_by_path: dict, run: Run, out: str) -> list[str]:
  """engine.hf.save of the host parameters, float32 where save takes a dtype."""
  kwargs = dict(model_config=run.config.model, vocab_size=run.setup.model.vocab_size, out=out)
  if 'dtype' in inspect.signature(hf.save).parameters:
    kwargs['dtype'] = 'float32'
  return hf.save(params_by_path, **kwargs)


@dataclasses.dataclass
class Measured:
  """What the engine computed on one checkpoint in one mode."""
  mode: str
  model: dict  # The model settings the engine read from config.json.
  logits: np.ndarray | None  # Auto mode: the forward pass's logits of tokens[:, :-1].
  eval_loss: float  # The mode's eval step on the loaded parameters.
  train_loss: float  # The loss the mode's train step reports (before its update).
  trained_logits: np.ndarray  # The auto forward pass on the parameters after the step.
  trained_eval_loss: float  # The mode's eval step on them.
  export_dir: str


def measure(path: str, mode: str, tokens_BL1: np.ndarray, export_dir: str,
            mesh: str = '2x2x2') -> Measured:
  """Loads the checkpoint as train.init_from=hf:PATH does, computes the logits and losses of
  the mode's own compiled steps, trains one step and exports the result to `export_dir`.
  A checkpoint the engine does not compute raises ConfigError before anything compiles."""
  parallel.check_modes(mode, '--modes')
  rows, seq_len = tokens_BL1.shape[0], tokens_BL1.shape[1] - 1
  config = engine_config(path, mode, mesh, rows, seq_len)
  run = assemble(config, mesh_devices(config), reads=VOCABULARY)
  setup = run.setup
  params = hf.load_params(path, setup.abstract_state()['params'])
  ops = AutoOps(setup)

  @jax.jit
  def forward(params, tokens_BL):
    return ops.prepare_params(nnx.merge(setup.graphdef, params))(tokens_BL, ops)

  batch = jax.device_put(tokens_BL1, setup.batch_sharding())
  inputs = tokens_BL1[:, :-1]
  logits = np.asarray(forward(params, inputs)) if mode == 'auto' else None
  eval_loss = float(run.steps.eval(params, batch))
  state, _ = setup.init(config.seed)
  state['params'] = params  # As engine.train does for train.init_from.
  state, metrics = run.steps.train(state, batch)  # Donates the loaded parameters.
  trained = state['params']
  trained_logits = np.asarray(forward(trained, inputs))
  trained_eval_loss = float(run.steps.eval(trained, batch))
  host = {p: np.asarray(v) for p, v in hf.by_path(jax.device_get(trained)).items()}
  save_export(host, run, export_dir)
  model = {key: run.config.model[key] for key in run.config.model}
  return Measured(mode, model, logits, eval_loss, float(metrics['loss']), trained_logits,
                  trained_eval_loss, export_dir)


def _within(diff: float | None, scale: float, rtol: float) -> bool:
  return diff is not None and math.isfinite(diff) and diff <= rtol * max(1.0, abs(scale))


def compare(family: str, fmt: str, measured: Measured, reference_logits: np.ndarray,
            tokens_BL1: np.ndarray, export_logits: np.ndarray,
            export_warnings: list[str]) -> dict:
  """One row: the engine's numbers against transformers' (its logits of the checkpoint, and
  of the engine's export after the step), with the verdict."""
  reference_logits = np.asarray(reference_logits, np.float64)
  reference_loss = next_token_loss(reference_logits, tokens_BL1)
  scale = float(np.abs(reference_logits).max())
  logits_diff = (None if measured.logits is None else
                 float(np.abs(measured.logits - reference_logits).max()))
  export_logits = np.asarray(export_logits, np.float64)
  export_loss = next_token_loss(export_logits, tokens_BL1)
  export_diff = float(np.abs(measured.trained_logits - export_logits).max())
  row = {
      'family': family, 'format': fmt, 'mode': measured.mode, 'status': 'ok',
      'logits_max_diff': logits_diff, 'logits_max_abs': scale,
      'reference_loss': reference_loss, 'eval_loss': measured.eval_loss,
      'train_step_loss': measured.train_loss,
      'eval_loss_diff': abs(measured.eval_loss - reference_loss),
      'train_loss_diff': abs(measured.train_loss - reference_loss),
      'export_logits_max_diff': export_diff,
      'export_logits_max_abs': float(np.abs(export_logits).max()),
      'export_reference_loss': export_loss,
      'export_eval_loss_diff': abs(measured.trained_eval_loss - export_loss),
      'load_warnings': list(export_warnings), 'model': measured.model,
      'tolerance': {'logits_rtol': LOGITS_RTOL, 'loss_rtol': LOSS_RTOL},
  }
  checks = {
      'logits': logits_diff is None or _within(logits_diff, scale, LOGITS_RTOL),
      'eval loss': _within(row['eval_loss_diff'], reference_loss, LOSS_RTOL),
      'train-step loss': _within(row['train_loss_diff'], reference_loss, LOSS_RTOL),
      'export logits': _within(export_diff, row['export_logits_max_abs'], LOGITS_RTOL),
      'export eval loss': _within(row['export_eval_loss_diff'], export_loss, LOSS_RTOL),
      'load warnings': not export_warnings,
  }
  row['failed'] = [name for name, ok in checks.items() if not ok]
  row['verdict'] = 'FAIL' if row['failed'] else 'PASS'
  return row


def not_checked(family: str, fmt: str, mode: str, status: str, verdict: str) -> dict:
  """A row for a checkpoint the engine refused ('refused: ...') or that could not be run."""
  return {'family': family, 'format': fmt, 'mode': mode, 'status': status, 'verdict': verdict}


def check(family: str, fmt: str, path: str, mode: str, tokens_BL1: np.ndarray,
          reference_logits: np.ndarray,
          reload: Callable[[str], tuple[np.ndarray, list[str]]], export_dir: str,
          mesh: str = '2x2x2') -> dict:
  """The whole check of one checkpoint in one mode: `reload(export_dir)` returns transformers'
  logits of the exported checkpoint on tokens[:, :-1] and what it warned while loading it."""
  try:
    measured = measure(path, mode, tokens_BL1, export_dir, mesh)
  except ConfigError as error:
    return not_checked(family, fmt, mode, f'refused: {error}', 'REFUSED')
  export_logits, warnings = reload(export_dir)
  return compare(family, fmt, measured, reference_logits, tokens_BL1, export_logits, warnings)


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
                                     'transformers >= 5, e.g. /work/hfref/bin/python.')
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
