"""tokenizer_check's engine side: a tokenizer of each kind trained on the text, each family's export
of it written by the export's own code (engine.hf.save.write_config and save_tokenizer: the
files AutoTokenizer reads), the engine's ids of the text, and each export's ids from transformers
(tokenizer_reference.py, a child process) compared with them. The command:
engine/analysis/tokenizer_check/__main__.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

from engine import config as config_lib
from engine import models
from engine.analysis import references
from engine.data import tokenizers as tokenizer_lib
from engine.data.bpe_trainer import train as train_bpe
from engine.errors import ConfigError
from engine.hf import save as hf_save

REFERENCE_SCRIPT = references.script('tokenizer_reference.py')
# The tokenizer files the engine exports: hf (a tokenizer.json: engine.data.train_tokenizer's
# byte-level BPE, alone and with a beginning-of-text token) and sentencepiece (a .model: BPE and
# unigram, SentencePiece's default normalisation).
KINDS = ('bpe', 'bpe_bos', 'sentencepiece_bpe', 'sentencepiece_unigram')
BEGIN_OF_TEXT = '<|begin_of_text|>'
MAX_LEN = 2048  # model.max_len of the exports' configs (tokenizer_config's model_max_length).


def architectures() -> list[str]:
  """Every Hugging Face architecture the engine exports."""
  return list(models.HF_FORMATS)


def make_tokenizer(kind: str, text: str, directory: str, vocab_size: int):
  """A tokenizer of `kind` trained on `text`, its file in `directory`, loaded as the engine
  loads it."""
  os.makedirs(directory, exist_ok=True)
  if kind.startswith('bpe'):
    path = os.path.join(directory, f'{kind}.json')
    tokenizer = train_bpe([text], vocab_size, path)
    if kind == 'bpe_bos':
      tokenizer.add_special_tokens([BEGIN_OF_TEXT])
      tokenizer.save(path)
    return tokenizer_lib.load('hf', path)
  if kind in ('sentencepiece_bpe', 'sentencepiece_unigram'):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    text_path = os.path.join(directory, 'text.txt')
    with open(text_path, 'w', encoding='utf-8') as f:
      f.write(text)
    prefix = os.path.join(directory, kind)
    sentencepiece.SentencePieceTrainer.train(
        input=text_path, model_prefix=prefix, vocab_size=vocab_size, minloglevel=2,
        model_type=kind.split('_')[1])
    return tokenizer_lib.load('sentencepiece', prefix + '.model')
  raise ConfigError(f'--kinds: {kind!r} is unknown; choose from {",".join(KINDS)}.')


def model_config(architecture: str):
  """The model settings of a small model that exports as `architecture`."""
  values = {'model.name': 'llama', 'model.hf_architecture': architecture,
            'model.max_len': MAX_LEN}
  if models.HF_FORMATS[architecture].moe:
    values.update({'model.num_experts': 4, 'model.experts_per_token': 2})
  return config_lib.with_values(config_lib.default_config(), values).model


def write_export(architecture: str, tokenizer, out: str) -> None:
  """The files of an `engine.export` of `architecture` that AutoTokenizer reads: config.json
  (its model_type), generation_config.json and the tokenizer files."""
  token_ids = {'bos_token_id': tokenizer.bos_id, 'eos_token_id': tokenizer.eos_id}
  hf_save.write_config(model_config(architecture), tokenizer.vocab_size, out, 'float32',
                       token_ids)
  hf_save.save_tokenizer(tokenizer, out, MAX_LEN)


def engine_ids(tokenizer, text: str) -> tuple[list[int], list[int]]:
  """(the engine's ids of `text`, the same after the beginning-of-text id where the tokenizer
  has one: what engine.generate and engine.evaluate feed the model, --add_bos)."""
  ids = tokenizer.encode(text).tolist()
  return ids, ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids


def first_difference(a: list[int], b: list[int]) -> int | None:
  """The first index where the lists differ (the shorter one's length if one is a prefix of the
  other); None if they are equal."""
  if a == b:
    return None
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass(frozen=True)
class Case:
  """One export: an architecture's files with one kind of tokenizer."""
  architecture: str
  kind: str
  directory: str
  tokenizer: object  # The engine's (engine.data.tokenizers).
  ids: list[int]  # Its ids of the text.
  ids_with_bos: list[int]


def compare(case: Case, reply: dict) -> dict:
  """One row of the report from transformers' reply for `case` (tokenizer_reference.py)."""
  row = {'architecture': case.architecture, 'kind': case.kind, 'engine_tokens': len(case.ids)}
  if 'error' in reply:
    return {**row, 'class': '—', 'transformers_tokens': None, 'verdict': 'ERROR',
            'failed': [reply['error'].splitlines()[0]]}
  failed = []
  plain = first_difference(case.ids, reply['ids'])
  if plain is not None:
    failed.append(f'ids differ from token {plain}')
  specials = first_difference(case.ids_with_bos, reply['ids_with_specials'])
  if specials is not None and plain is None:
    failed.append(f'special tokens differ from token {specials}')
  known = [i for i in case.ids if i != reply['unk_id']]  # An unknown id decodes as a marker.
  decoded = first_difference(list(case.tokenizer.decode(known)), list(reply['decoded']))
  if decoded is not None and plain is None:
    failed.append(f'decodes differently from character {decoded}')
  if reply['warnings']:
    failed.append(f'load warning: {reply["warnings"][0]}')
  return {**row, 'class': reply['class'], 'transformers_tokens': len(reply['ids']),
          'verdict': 'FAIL' if failed else 'PASS', 'failed': failed}


def check_transformers_python(python: str) -> None:
  """ConfigError, before anything is trained, if `python` cannot import what the child needs."""
  install = 'pip install transformers sentencepiece protobuf'
  try:
    done = subprocess.run([python, '-c', 'import transformers, sentencepiece, google.protobuf'],
                          capture_output=True, text=True, timeout=300)
  except OSError as error:
    raise ConfigError(f'--transformers_python={python}: cannot run it ({error.strerror}); pass '
                      f'a Python with transformers, sentencepiece and protobuf ({install}).'
                      ) from None
  if done.returncode != 0:
    said = done.stderr.strip().splitlines()
    raise ConfigError(f'--transformers_python={python} cannot import transformers, sentencepiece '
                      f'and protobuf ({said[-1] if said else f"exit status {done.returncode}"}); '
                      f'install them into it ({install}) or pass another Python.')


def run_transformers(python: str, text_file: str, directories: list[str]) -> dict:
  """tokenizer_reference.py run by `python` on every directory; its versions. Each directory's
  reply is in DIR/transformers_ids.json."""
  request = os.path.join(os.path.dirname(directories[0]), 'request.json')
  with open(request, 'w') as f:
    json.dump({'text_file': os.path.abspath(text_file), 'dirs': directories}, f)
  done = subprocess.run([python, REFERENCE_SCRIPT, request], capture_output=True, text=True,
                        timeout=3600)
  if done.returncode != 0:
    said = done.stderr.strip().splitlines()
    raise RuntimeError(f'{python} {REFERENCE_SCRIPT} {request} stopped'
                       + (f': {said[-1]}' if said else '') + '; run it by hand to see why.')
  return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], title: str) -> str:
  lines = [f'## {title}', '',
           '| architecture | tokenizer | AutoTokenizer class | tokens: engine | tokens: '
           'transformers | verdict |', '|---|---|---|---|---|---|']
  for row in rows:
    count = '—' if row['transformers_tokens'] is None else f'{row["transformers_tokens"]:,}'
    verdict = row['verdict'] + (f' ({"; ".join(row["failed"])})' if row['failed'] else '')
    lines.append(f'| {row["architecture"]} | {row["kind"]} | {row["class"]} | '
                 f'{row["engine_tokens"]:,} | {count} | {verdict.replace("|", "/")} |')
  return '\n'.join(lines)
