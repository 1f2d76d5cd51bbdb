"""Exported tokenizers tokenize as the engine does. Without transformers: every architecture's
export of a tokenizer.json, loaded by the `tokenizers` library as PreTrainedTokenizerFast loads
it, gives the engine's ids on all of tinyshakespeare (the beginning-of-text id first where it has
one, by a post-processor the export adds), and tokenizer_config.json names a class that
takes the file as written (never one that transformers rebuilds around the vocabulary by model
type). With transformers (the reference environment, never the engine's:
tests/support/reference_envs.py): the same through AutoTokenizer, `python -m
engine.analysis.tokenizer_check`, on the text's first quarter and the lines with the characters
it lacks (280 KB: every character of the text; all of it took 2 minutes of the suite), and its
measured table on all of it is in docs/benchmarks.md."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import tokenizers

from engine.analysis.tokenizer_check import engine_side as tc
from engine.hf import save as hf_save
from tests.support.helpers import reference_python

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT_FILE = ROOT / 'experiments/data/tinyshakespeare.txt'
# Classes transformers builds from the vocabulary with a pre-tokenizer and normaliser of their
# own (the ones model types map to): never the exported class.
REBUILDING = ('Qwen2Tokenizer', 'LlamaTokenizer', 'LlamaTokenizerFast', 'GPT2Tokenizer',
              'TokenizersBackend')
# The classes that load each kind's file whole, with its own normaliser and pre-tokenizer.
TAKES_THE_FILE = {'hf': 'PreTrainedTokenizerFast', 'sentencepiece': 'SentencePieceBackend'}


@pytest.fixture(scope='module')
def text():
  return TEXT_FILE.read_text(encoding='utf-8')


@pytest.fixture(scope='module')
def exports(tmp_path_factory, text):
  """Every architecture's export of each tokenizer.json kind, trained on the whole text:
  {(architecture, kind): (directory, engine tokenizer)}."""
  directory = tmp_path_factory.mktemp('tokenizer_exports')
  made = {}
  for kind in ('bpe', 'bpe_bos'):
    tokenizer = tc.make_tokenizer(kind, text, str(directory / 'tokenizers'), 512)
    for architecture in tc.architectures():
      out = directory / f'{architecture}_{kind}'
      tc.write_export(architecture, tokenizer, str(out))
      made[architecture, kind] = str(out), tokenizer
  return made


def test_every_export_gives_the_engines_ids_on_a_long_text(exports, text):
  """tokenizer.json as PreTrainedTokenizerFast runs it: the `tokenizers` library, special tokens
  by default (the beginning-of-text id first, as the engine's prompts start) or not. Each
  distinct file is encoded once (the architectures' exports of one kind are the same file)."""
  engine, checked = {}, {}
  for (architecture, kind), (directory, tokenizer) in exports.items():
    if kind not in engine:
      engine[kind] = tc.engine_ids(tokenizer, text)
      assert tokenizer.decode(engine[kind][0]) == text
    ids, ids_with_bos = engine[kind]
    assert len(ids) > 300_000, (architecture, kind)  # All of it, in a 512-token vocabulary.
    assert (ids_with_bos[0] == tokenizer.bos_id) == (kind == 'bpe_bos')
    content = pathlib.Path(directory, 'tokenizer.json').read_text()
    if content not in checked:
      backend = tokenizers.Tokenizer.from_str(content)
      checked[content] = (backend.encode(text).ids,
                          backend.encode(text, add_special_tokens=False).ids,
                          backend.decode(ids, skip_special_tokens=False))
    assert checked[content] == (ids_with_bos, ids, text), (architecture, kind)
  assert len(checked) == 2  # One file per kind, whatever the architecture.


def _takes_the_file_as_written(directory: str) -> str:
  """'' if tokenizer_config.json names a class that loads the file unchanged whatever the
  config's model_type, else why not."""
  with open(os.path.join(directory, 'tokenizer_config.json')) as f:
    config = json.load(f)
  kind = 'hf' if os.path.exists(os.path.join(directory, 'tokenizer.json')) else 'sentencepiece'
  if config['tokenizer_class'] in REBUILDING:
    return f'{config["tokenizer_class"]} rebuilds the tokenizer around the vocabulary'
  if config['tokenizer_class'] != TAKES_THE_FILE[kind]:
    return f'{config["tokenizer_class"]} is not the class that loads a {kind} file whole'
  # Without auto_map, transformers 5 takes the model type's class for qwen2 whatever the file
  # names; with it, and without trust_remote_code, tokenizer_class loads.
  module, _, name = (config.get('auto_map', {}).get('AutoTokenizer') or [None, '..'])[1] \
      .partition('.')
  source = pathlib.Path(directory, f'{module}.py')
  if not source.exists():
    return 'no auto_map class file: the model type chooses the class'
  classes = {node.name: [base.id for base in node.bases]
             for node in ast.parse(source.read_text()).body if isinstance(node, ast.ClassDef)}
  if classes.get(name) != [config['tokenizer_class']]:
    return f'{source.name} defines no {name}({config["tokenizer_class"]})'
  return ''


def test_tokenizer_config_names_a_class_that_takes_the_file_as_written(exports, tmp_path):
  for (architecture, kind), (directory, _) in exports.items():
    assert _takes_the_file_as_written(directory) == '', (architecture, kind)
  # A SentencePiece model too (its normaliser kept by the sentencepiece library itself).
  sentencepiece = tc.make_tokenizer('sentencepiece_unigram', (ROOT / 'README.md').read_text(),
                                    str(tmp_path / 'sp'), 200)
  tc.write_export('Qwen2ForCausalLM', sentencepiece, str(tmp_path / 'qwen2_sp'))
  assert _takes_the_file_as_written(str(tmp_path / 'qwen2_sp')) == ''
  config = json.loads((tmp_path / 'qwen2_sp' / 'tokenizer_config.json').read_text())
  assert config['tokenizer_class'] == 'SentencePieceBackend'
  assert config['add_bos_token'] and config['special_tokens_pattern'] == 'bos'


@pytest.mark.parametrize('planted', ['class', 'auto_map'])
def test_the_class_check_catches_an_export_transformers_would_rebuild(exports, tmp_path,
                                                                      monkeypatch, planted):
  """The export as it was (a Qwen2 one took Qwen2Tokenizer, the model type's class) fails."""
  directory, tokenizer = exports['Qwen2ForCausalLM', 'bpe']
  if planted == 'class':
    monkeypatch.setitem(hf_save.TOKENIZER_CLASSES, 'hf', 'Qwen2Tokenizer')
  else:
    real = hf_save.tokenizer_config
    monkeypatch.setattr(hf_save, 'tokenizer_config', lambda *args: {
        k: v for k, v in real(*args).items() if k != 'auto_map'})
  tc.write_export('Qwen2ForCausalLM', tokenizer, str(tmp_path / 'planted'))
  assert _takes_the_file_as_written(str(tmp_path / 'planted')) != ''
  assert _takes_the_file_as_written(directory) == ''


@pytest.mark.slow
def test_autotokenizer_gives_the_engines_ids_in_a_transformers_environment(tmp_path):
  python = reference_python()
  text = TEXT_FILE.read_text(encoding='utf-8')
  head = text[:len(text) // 4]
  seen = set(head)
  head += ''.join(line for line in text.splitlines(keepends=True) if set(line) - seen)
  assert set(head) == set(text)  # Every character the text has.
  (tmp_path / 'head.txt').write_text(head, encoding='utf-8')
  proc = subprocess.run(
      [sys.executable, '-m', 'engine.analysis.tokenizer_check', f'--transformers_python={python}',
       f'--text_file={tmp_path / "head.txt"}', f'--out={tmp_path / "tok"}'], cwd=ROOT,
      capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
  rows = json.loads((tmp_path / 'tok.json').read_text())['rows']
  assert len(rows) == len(tc.architectures()) * len(tc.KINDS)
  assert all(row['verdict'] == 'PASS' for row in rows), rows
