"""Writes a run's latest checkpoint as a Hugging Face Llama checkpoint (engine/hf.py).

  python -m engine.export --workdir=/tmp/run --format=hf --out=/tmp/run_hf

Reads WORKDIR/config.json, restores the newest intact checkpoint's parameters onto this
machine's devices (any mesh it was trained on), and writes `config.json` and
`model.safetensors` in Hugging Face's Llama layout, float32, head untied.
"""

from __future__ import annotations


import jax
import numpy as np
from absl import app, flags

from engine import config as config_lib
from engine import data, hf
from engine import workdir as workdir_lib
from engine.checkpoint import CheckpointError, restore_params
from engine.flag_errors import fail
from engine.library_output import quiet_library_output
from engine.train import build_setup, resolve_vocab_size

FORMATS = ('hf',)


def export(workdir: str, out: str) -> list[str]:
  """The latest checkpoint of `workdir` written to `out`; returns the tensor names."""
  # Every parameter whole on this machine's devices (replicated), whatever mesh trained it.
  config = workdir_lib.read_run_config(workdir, '-1x1x1')
  if config.model.name != 'llama':
    raise config_lib.ConfigError(f'--workdir={workdir} trained model.name='
                                 f'{config.model.name!r}; --format=hf writes Llama models only.')
  vocab = (config.model.vocab_size if config.model.vocab_size != -1 else
           data.load_corpus(config.data, config.seed).tokenizer.vocab_size)
  vocab = resolve_vocab_size(config.model, vocab)
  train_setup = build_setup(config, vocab)
  params = restore_params(workdir, train_setup.abstract_state()['params'])
  host = {path: np.asarray(jax.device_get(v)) for path, v in hf.by_path(params).items()}
  return hf.save(host, config.model, vocab, out)


def main():
  """Command line; flags are defined here, not at import, so tests can import this module."""
  workdir = flags.DEFINE_string('workdir', None, 'The training run to export.')
  flags.DEFINE_enum('format', 'hf', FORMATS, 'Output format: hf (Hugging Face), the only one.')
  out = flags.DEFINE_string('out', None, 'Directory to write.')
  flags.mark_flags_as_required(['workdir', 'out'])

  def run(argv):
    del argv
    quiet_library_output()
    try:
      names = export(workdir.value, out.value)
    except (config_lib.ConfigError, CheckpointError) as e:
      fail(str(e))
    print(f'Wrote {len(names)} tensors and config.json to {out.value}')

  app.run(run)


if __name__ == '__main__':
  main()
