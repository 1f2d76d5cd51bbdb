"""Writes a run's latest checkpoint as a Hugging Face checkpoint (engine/hf.py writes the files;
the model family's HFFormat, e.g. engine/models/llama_hf.py, names the tensors).

  python -m engine.export --workdir=/tmp/run --format=hf --out=/tmp/run_hf

Reads WORKDIR/config.json, restores the newest intact checkpoint's parameters onto this
machine's devices (any mesh it was trained on), and writes `config.json` and
`model.safetensors` in the family's Hugging Face layout (Llama: float32, head untied).
"""

from __future__ import annotations


import jax
import numpy as np
from absl import flags

from engine import config as config_lib
from engine import hf, models
from engine.assemble import VOCABULARY, assemble_finished_run
from engine.checkpoint import restore_params
from engine.cli import run_command

FORMATS = ('hf',)


def export(workdir: str, out: str) -> list[str]:
  """The latest checkpoint of `workdir` written to `out`; returns the tensor names."""
  # Every parameter whole on this machine's devices (replicated), whatever mesh trained it.
  run = assemble_finished_run(workdir, '-1x1x1', reads=VOCABULARY)
  config = run.config
  if config.model.name not in models.HF_FORMATS:
    raise config_lib.ConfigError(
        f'--workdir={workdir} trained model.name={config.model.name!r}; --format=hf writes '
        f'{", ".join(sorted(models.HF_FORMATS))} models only.')
  params = restore_params(workdir, run.setup.abstract_state()['params'])
  host = {path: np.asarray(jax.device_get(v)) for path, v in hf.by_path(params).items()}
  return hf.save(host, config.model, run.setup.model.vocab_size, out)


def main():
  """Command line; flags are defined here, not at import, so tests can import this module."""
  workdir = flags.DEFINE_string('workdir', None, 'The training run to export.')
  flags.DEFINE_enum('format', 'hf', FORMATS, 'Output format: hf (Hugging Face), the only one.')
  out = flags.DEFINE_string('out', None, 'Directory to write.')

  def run(argv):
    del argv
    names = export(workdir.value, out.value)
    print(f'Wrote {len(names)} tensors and config.json to {out.value}')

  run_command(run, 'engine.export', required=('workdir', 'out'))


if __name__ == '__main__':
  main()
