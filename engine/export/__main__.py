"""The command line of engine.export: `python -m engine.export --workdir=RUN --out=DIR` (the
export itself: engine/export/exporter.py)."""

from absl import flags

from engine.cli.command_line import run_command
from engine.export.exporter import export_files
from engine.hf import save as hf_save

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run to export.')
_OUT = flags.DEFINE_string('out', None, 'Directory to write.')
_ADAPTERS = flags.DEFINE_enum('adapters', 'merged', ['merged', 'peft'], 'A LoRA run: its '
                              'adapters merged into the weights, or written alone as a PEFT '
                              'adapter.')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', list(hf_save.DTYPES),
                           'The dtype of the written tensors.')


def main(argv):
  del argv
  written = export_files(_WORKDIR.value, _OUT.value, _DTYPE.value, _ADAPTERS.value)
  print(f'Wrote {len(written.tensors)} tensors ({_DTYPE.value}) and {", ".join(written.files)} '
        f'to {_OUT.value}\nTokenizer: {written.tokenizer}')


if __name__ == '__main__':
  run_command(main, 'engine.export', required=('workdir', 'out'))
