"""The engine's exported tokenizers checked against transformers' AutoTokenizer on a long text.

  python -m engine.analysis.tokenizer_check --transformers_python=/path/to/python-with-transformers
  \
      [--text_file=experiments/data/tinyshakespeare.txt] [--kinds=bpe,bpe_bos,sentencepiece_bpe,...] \
      [--architectures=LlamaForCausalLM,...] [--vocab_size=1024] [--out=/tmp/tok] [--dir=KEEP]

For every tokenizer kind the engine exports (tokenizer_compare.KINDS: engine.data.train_tokenizer's
byte-level BPE, alone and with a beginning-of-text token, and SentencePiece BPE and unigram
models), trained on --text_file (default: the engine's embedded corpus), and every Hugging Face
architecture engine.export writes, this process writes the export's config.json and tokenizer
files with the export's own code (engine/hf/save.py) and encodes the whole text with the engine's
tokenizer. A child process run by --transformers_python (a Python with transformers; torch is
not needed: engine/analysis/references/tokenizer_reference.py) loads each export with
`AutoTokenizer.from_pretrained`, which picks its class from tokenizer_config.json and the
config's model_type, and encodes the same text.

Prints a Markdown table (architecture | tokenizer | AutoTokenizer class | tokens: engine | tokens:
transformers | verdict) and, with --out, writes OUT.md and OUT.json. A row PASSes when
transformers' ids are the engine's, token for token (and, with its default special tokens, the
engine's ids after the beginning-of-text id where the tokenizer has one, as engine.generate and
engine.evaluate start), they decode to the engine's decoding of its ids (unknown ids left out:
sentencepiece writes each as " ⁇ ", transformers as its unk_token), and the export loaded without
a warning.
Exit status 1 if any row FAILs or errs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from absl import flags, logging

from engine.analysis.tokenizer_check import engine_side as tc
from engine.analysis.hf_check.checker import chosen
from engine.cli.command_line import check_out_prefix, run_command
from engine.data import sources

_PYTHON = flags.DEFINE_string('transformers_python', None, 'A Python with transformers (and '
                              'sentencepiece, protobuf), e.g. ENV/bin/python.')
_TEXT = flags.DEFINE_string('text_file', 'embedded', 'The text to tokenize: a file, or '
                            '"embedded" (the engine\'s built-in corpus).')
_KINDS = flags.DEFINE_list('kinds', list(tc.KINDS), 'Tokenizer kinds to check.')
_ARCHITECTURES = flags.DEFINE_list('architectures', None, 'Hugging Face architectures to check '
                                   '(default: every one engine.export writes).')
_VOCAB = flags.DEFINE_integer('vocab_size', 1024, 'Vocabulary size of the trained tokenizers.')
_OUT = flags.DEFINE_string('out', None, 'Write OUT.md and OUT.json.')
_KEEP = flags.DEFINE_string('dir', None, 'Keep the tokenizers and exports here (default: a '
                            'temporary directory, removed at the end).')


def check(python: str, text_file: str, kinds, architectures, vocab_size: int,
          directory: str) -> tuple[list[dict], dict]:
  """Every kind x architecture; (the rows, transformers' versions)."""
  text = '\n'.join(sources.read_inputs([text_file]))
  cases = []
  for kind in kinds:
    logging.info('%s: training a tokenizer of %d tokens, encoding %d characters', kind,
                 vocab_size, len(text))
    tokenizer = tc.make_tokenizer(kind, text, os.path.join(directory, 'tokenizers'), vocab_size)
    ids, ids_with_bos = tc.engine_ids(tokenizer, text)
    for architecture in architectures:
      out = os.path.join(directory, f'{architecture}_{kind}')
      tc.write_export(architecture, tokenizer, out)
      cases.append(tc.Case(architecture, kind, out, tokenizer, ids, ids_with_bos))
  text_path = os.path.join(directory, 'text.txt')
  with open(text_path, 'w', encoding='utf-8') as f:
    f.write(text)
  logging.info('AutoTokenizer on %d exports', len(cases))
  versions = tc.run_transformers(python, text_path, [case.directory for case in cases])
  rows = []
  for case in cases:
    with open(os.path.join(case.directory, 'transformers_ids.json')) as f:
      rows.append(tc.compare(case, json.load(f)))
  return rows, versions


def main(argv):
  del argv
  check_out_prefix(_OUT.value)
  kinds = chosen(_KINDS.value, tc.KINDS, '--kinds')
  architectures = chosen(_ARCHITECTURES.value or tc.architectures(), tc.architectures(),
                         '--architectures')
  tc.check_transformers_python(_PYTHON.value)
  directory = _KEEP.value or tempfile.mkdtemp(prefix='tokenizer_check_')
  os.makedirs(directory, exist_ok=True)
  try:
    rows, versions = check(_PYTHON.value, _TEXT.value, kinds, architectures, _VOCAB.value,
                           directory)
  finally:
    if not _KEEP.value:
      shutil.rmtree(directory, ignore_errors=True)
  title = (f'Exported tokenizers: the engine against AutoTokenizer (transformers '
           f'{versions["transformers"]}, tokenizers {versions["tokenizers"]}) on '
           f'{"the embedded corpus" if _TEXT.value == "embedded" else os.path.basename(_TEXT.value)}')
  report = tc.markdown(rows, title)
  print(report)
  if _OUT.value:
    with open(_OUT.value + '.md', 'w') as f:
      f.write(report + '\n')
    with open(_OUT.value + '.json', 'w') as f:
      json.dump({'title': title, 'versions': versions, 'rows': rows}, f, indent=1)
    logging.info('Wrote %s.md and %s.json', _OUT.value, _OUT.value)
  if any(row['verdict'] != 'PASS' for row in rows):
    sys.exit(1)


if __name__ == '__main__':
  run_command(main, 'engine.analysis.tokenizer_check', required=('transformers_python',))
