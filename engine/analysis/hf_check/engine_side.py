"""The engine's side of `python -m engine.analysis.hf_check`: one Hugging Face checkpoint loaded
as `train.init_from=hf:DIR` does, measured in one mode, and compared with transformers' numbers.

  engine_config / measure  the run train.init_from=hf:DIR makes (engine.assemble on the mesh),
                           its logits (auto mode), the mode's eval loss and the loss of one
                           train step, then the trained parameters exported with engine.hf.save.save
  compare                  one row: those numbers against transformers' logits of the
                           checkpoint and of the export, within the tolerances below, and the
                           warnings transformers gave loading the export; the verdict
  check                    measure, reload the export (a callable: transformers in
                           the command's child process, a NumPy Llama in the tests), compare;
                           a checkpoint the engine refuses (ConfigError) is a REFUSED row

__main__.py is the command around it: flags, the child process, the report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from engine import config as config_lib
from engine import parallel
from engine.hf import load as hf
from engine.hf import save as hf_save
from engine.assemble import VOCABULARY, Run, assemble
from engine.errors import ConfigError
from engine.parallel.auto import AutoOps

# Tolerances. Float32 sums taken in another order (sharded partial sums, other kernels) differ by
# a few ulps per operation: the measured differences (docs/benchmarks.md, "Hugging Face
# checkpoints against transformers") sit well inside these, while a wrong rotary frequency, a
# dropped bias or norm, or a transposed head moves logits by 1e-2 or more.
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
  return config_lib.with_values(config_lib.default_config(), {
      'model.name': 'llama', 'train.init_from': f'{hf.PREFIX}{path}',
      'parallelism.mode': mode, **config_lib.mesh_values(mesh, '--mesh'),
      'data.source': 'synthetic', 'data.seq_len': seq_len, 'data.global_batch_size': rows,
      'train.num_steps': 1, 'train.eval_batches': 1, 'optim.warmup_steps': 0,
      'optim.learning_rate': LEARNING_RATE, 'optim.end_learning_rate': LEARNING_RATE,
      'seed': SEED,
      # A mixture of experts' step loss is the cross-entropy alone, as transformers' (which adds
      # its router loss only with output_router_logits).
      'model.moe_aux_loss_coef': 0.0, 'model.moe_z_loss_coef': 0.0})


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
  """engine.hf.save.save of the host parameters, in float32."""
  return hf_save.save(params_by_path, run.config.model, run.setup.model.vocab_size, out,
                      dtype='float32')


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
  steps = run.steps_for(mode)
  eval_loss = float(steps.eval(params, batch))
  state, _ = setup.init(config.seed)
  state['params'] = params  # As engine.train does for train.init_from.
  state, metrics = steps.train(state, batch)  # Donates the loaded parameters.
  trained = state['params']
  trained_logits = np.asarray(forward(trained, inputs))
  trained_eval_loss = float(steps.eval(trained, batch))
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
