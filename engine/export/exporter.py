"""Writes a run's latest checkpoint as a Hugging Face checkpoint (engine/hf/save.py writes the
files; the model family's HFFormat, e.g. engine/models/formats/llama.py, names the tensors).

  python -m engine.export --workdir=/tmp/run --out=/tmp/run_hf [--dtype=bfloat16]

Reads WORKDIR/config.json, restores the newest intact checkpoint's parameters onto this
machine's devices (any mesh it was trained on), and writes a directory that transformers'
`AutoModelForCausalLM` and `AutoTokenizer` load:

  config.json              the family's Hugging Face config (Llama: head untied; a mixture of
                           experts as Mixtral, or Qwen3-MoE with model.qk_norm), with the run's
                           tokenizer's bos / eos ids (null where it has none) and the dtype;
  generation_config.json   the same bos / eos ids;
  model.safetensors        the parameters, in --dtype (float32, bfloat16 or float16);
  tokenizer files          the run's tokenizer (for shards, the one their meta.json names):
                           data.tokenizer=hf: tokenizer.json, sentencepiece: tokenizer.model, each
                           with a tokenizer_config.json naming a class that takes the file as
                           written, whatever the model type (and tokenization_exported.py, that
                           class for trust_remote_code=True; engine/hf/save.py says why); byte
                           and char vocabularies have no Hugging Face tokenizer file, and none is
                           written.

A LoRA run (model.lora_rank > 0) is written with its adapters merged into the weights (W +
lora_alpha / lora_rank A B), or with --adapters=peft as a PEFT adapter instead of the weights
(adapter_config.json and adapter_model.safetensors, beside the tokenizer files), which
`peft.PeftModel.from_pretrained` loads onto the base checkpoint (engine/hf/lora_export.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import jax
import numpy as np

from engine import models
from engine.hf import load as hf
from engine.hf import lora_export
from engine.hf import save as hf_save
from engine.models.llama import lora
from engine.workdir import run_dir as workdir_lib
from engine.assemble import TOKENIZER, assemble_finished_run
from engine.workdir.checkpoint import restore_params
from engine.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Exported:
  """What export_files wrote."""
  tensors: list[str]  # The safetensors names.
  files: list[str]  # The files of the output directory, sorted.
  tokenizer: str  # A line on the tokenizer files (or why there are none).


def export(workdir: str, out: str, dtype: str = 'float32') -> list[str]:
  """The latest checkpoint of `workdir` written to `out`; returns the tensor names."""
  return export_files(workdir, out, dtype).tensors


ADAPTERS_AS = ('merged', 'peft')

# What a Hugging Face checkpoint directory holds: an --out holding only these is a previous export
# (or a download), which an export replaces whole.
_CHECKPOINT_FILES = re.compile(
    r'^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors|'
    r'model\.safetensors\.index\.json|tokenizer(_config)?\.json|tokenizer\.model|'
    r'special_tokens_map\.json|tokenization_exported\.py|adapter_config\.json|'
    r'adapter_model\.safetensors)$')


def _check_out(out: str) -> None:
  """--out must be new, empty, or a Hugging Face checkpoint (replaced whole, so that no file of
  the old one, such as a sharded index, outlives it)."""
  parent = os.path.dirname(out)
  if not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
    raise ConfigError(
        f'--out={out}: {parent} is not a directory this process can write (the export is staged '
        'beside --out, then renamed); pass a path in one.')
  if not os.path.exists(out):
    return
  if not os.path.isdir(out):
    raise ConfigError(f'--out={out} is a file; pass a directory to write.')
  foreign = sorted(name for name in os.listdir(out) if not (
      _CHECKPOINT_FILES.match(name) and os.path.isfile(os.path.join(out, name))))
  if foreign:
    raise ConfigError(
        f'--out={out} holds {len(foreign)} entries that are not a Hugging Face checkpoint\'s, e.g. '
        f'{foreign[0]!r}; pass a new or empty directory (an earlier export there is replaced '
        'whole).')


def _replace(staged: str, out: str) -> None:
  """The staged export becomes `out`; an earlier one there goes only once it has."""
  old = f'{out}.replaced-by-export'
  if os.path.exists(out):
    os.replace(out, old)
  os.replace(staged, out)
  shutil.rmtree(old, ignore_errors=True)


def export_files(workdir: str, out: str, dtype: str = 'float32',
                 adapters_as: str = 'merged') -> Exported:
  """The latest checkpoint of `workdir` and its tokenizer written to `out` (module docstring):
  written beside it first, then put in its place, replacing an earlier export whole. A LoRA
  run's adapters are merged into the weights, or (`adapters_as='peft'`) written alone as a PEFT
  adapter (engine/hf/lora_export.py)."""
  if dtype not in hf_save.DTYPES:
    raise ConfigError(f'--dtype={dtype}: choose one of {", ".join(hf_save.DTYPES)}.')
  if not out.strip():
    raise ConfigError('--out is empty; pass the directory to write, e.g. '
                      '--out=/tmp/hf_export.')
  out = os.path.abspath(out)
  _check_out(out)
  # Every parameter whole on this machine's devices (replicated), whatever mesh trained it; the
  # tokenizer that decodes (for shards, the file their meta.json names).
  run = assemble_finished_run(workdir, '-1x1x1', reads=TOKENIZER)
  config, tokenizer = run.config, run.tokenizer
  fmt = models.hf_format_for(config.model)
  if fmt is None:
    families = sorted({fmt.model for fmt in models.HF_FORMATS.values()})
    raise ConfigError(
        f'--workdir={workdir} trained model.name={config.model.name!r}; writes '
        f'{", ".join(families)} models only.')
  why = models.unwritable(fmt, config.model)
  if why:  # A mixture of experts no Hugging Face architecture computes the same way.
    raise ConfigError(
        f'--workdir={workdir} trained {why}, which a Hugging Face export cannot write as '
        f'{fmt.architecture}; use the run with engine.generate and engine.evaluate.')
  adapters = lora.from_config(config.model)
  if adapters_as not in ADAPTERS_AS:
    raise ConfigError(f'--adapters={adapters_as}: choose merged or peft.')
  if adapters_as == 'peft' and adapters is None:
    raise ConfigError(f'--adapters=peft: --workdir={workdir} trained no LoRA adapters '
                      '(model.lora_rank=0); export it whole without --adapters.')
  params = restore_params(workdir, run.setup.abstract_state()['params'])
  host = {path: np.asarray(jax.device_get(v)) for path, v in hf.by_path(params).items()}
  token_ids = {'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id}
  staged = f'{out}.export-in-progress'
  shutil.rmtree(staged, ignore_errors=True)  # A failed export's leftovers: ours to remove.
  try:
    if adapters_as == 'peft':
      # The base checkpoint the run started from (config.json records it).
      base = hf.path_of(workdir_lib.read_run_config(workdir).train.init_from) or ''
      names = lora_export.save_adapter(host, fmt, adapters, staged, base, hf_save.DTYPES[dtype])
    else:
      weights = host if adapters is None else lora_export.merged(host, adapters)
      names = hf_save.save(weights, config.model, run.setup.model.vocab_size, staged, dtype,
                           token_ids)
    line = hf_save.save_tokenizer(tokenizer, staged, config.model.max_len)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise
  _replace(staged, out)
  return Exported(names, sorted(os.listdir(out)), line)
