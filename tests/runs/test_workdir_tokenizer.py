"""The workdir keeps the run's tokenizer (engine/workdir/tokenizer.py): a finished run on shards
generates, evaluates and exports with its original tokenizer file and shard set gone."""

import hashlib
import json
import shutil

import jax
import numpy as np
import pytest
from etils import epath

from engine import data
from engine.workdir import tokenizer as run_tokenizer
from engine.assemble import CORPUS, TOKENIZER, VOCABULARY, assemble_finished_run
from engine.config import default_config
from engine.errors import ConfigError
from engine.data import tokenizers as tokenizer_lib
from engine.data.shard_writer import prepare
from engine.data.bpe_trainer import train as train_bpe
from engine.generate.sampling import load_run
from engine.main import run as run_main

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

TEXT = 'the 1234 numbers 567, and 89\n'


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A 2-step run on a shard set of a small BPE: (workdir, tokenizer file, shard set)."""
  root = tmp_path_factory.mktemp('run')
  rng = np.random.default_rng(0)
  (root / 'corpus').mkdir()
  for i in range(3):
    lines = [' '.join(map(str, rng.integers(0, 2000, 12))) for _ in range(150)]
    (root / 'corpus' / f'doc{i}.txt').write_text('\n'.join(lines) + '\n')
  bpe = str(root / 'tokenizer.json')
  train_bpe(data.documents(str(root / 'corpus')), 300, bpe)
  shard_set = str(root / 'set')
  prepare([str(root / 'corpus')], 'hf', bpe, shard_set, processes=1, record_tokens=64,
          records_per_shard=8, piece_bytes=2000)
  workdir = root / 'workdir'
  assert run_main(_argv(workdir, shard_set)) == 0
  return workdir, bpe, shard_set


def _argv(workdir, shard_set) -> list[str]:
  return ['--config=experiments/tiny.py', f'--workdir={workdir}', '--config.mesh.data=8',
          '--config.data.source=shards', f'--config.data.shards={shard_set}',
          '--config.data.seq_len=16', '--config.data.tokenizer=hf', '--config.train.num_steps=2',
          '--config.train.eval_batches=1']


def test_a_finished_run_decodes_with_its_kept_tokenizer_after_the_originals_move(finished):
  workdir, bpe, shard_set = finished
  original = tokenizer_lib.load('hf', bpe)
  kept = workdir / 'tokenizer' / 'tokenizer.json'
  assert kept.read_bytes() == open(bpe, 'rb').read()
  record = json.loads((workdir / 'config.json').read_text())['tokenizer']
  assert record == {'kind': 'hf', 'file': 'tokenizer/tokenizer.json',
                    'sha256': hashlib.sha256(kept.read_bytes()).hexdigest()}
  shutil.move(bpe, bpe + '.moved')
  shutil.move(shard_set, shard_set + '.moved')
  try:
    run, params = load_run(str(workdir))  # engine.generate's loading.
    assert run.tokenizer.path == str(kept)
    ids = run.tokenizer.encode(TEXT)
    np.testing.assert_array_equal(ids, original.encode(TEXT))
    assert run.tokenizer.decode(ids) == TEXT
    assert jax.tree.leaves(params) and run.setup.model.vocab_size >= original.vocab_size
    exported = assemble_finished_run(str(workdir), '1x1x1', reads=VOCABULARY)
    assert exported.tokenizer.vocab_size == original.vocab_size
    # Evaluation of the held-out split still reads the shard set, checked against the copy.
    shutil.move(shard_set + '.moved', shard_set)
    evaluated = assemble_finished_run(str(workdir), '1x1x1', reads=CORPUS)
    assert evaluated.corpus.shard_sets and evaluated.tokenizer.path == str(kept)
  finally:
    for path in (bpe, shard_set):
      if not epath.Path(path).exists():
        shutil.move(path + '.moved', path)


def test_a_damaged_or_missing_copy_is_refused(finished, tmp_path):
  workdir = tmp_path / 'copy'
  shutil.copytree(finished[0], workdir)
  kept = workdir / 'tokenizer' / 'tokenizer.json'
  kept.write_text(kept.read_text() + ' ')
  with pytest.raises(ConfigError, match='does not match the SHA-256 that config.json records'):
    load_run(str(workdir))
  kept.unlink()
  with pytest.raises(ConfigError, match='which is missing; restore it'):
    load_run(str(workdir))


def test_resume_keeps_the_copy_and_refuses_another_tokenizer(finished, tmp_path):
  workdir, bpe, shard_set = finished
  kept = workdir / 'tokenizer' / 'tokenizer.json'
  before = kept.stat().st_mtime_ns
  assert run_main(_argv(workdir, shard_set)) == 0  # Resumes at step 2: nothing to train.
  assert kept.stat().st_mtime_ns == before
  assert 'tokenizer' in json.loads((workdir / 'config.json').read_text())
  tokenizer = tokenizer_lib.load('hf', bpe)
  run_tokenizer.check_resumed(tokenizer, epath.Path(workdir))
  assert run_tokenizer.save(tokenizer, epath.Path(workdir))['file'] == 'tokenizer/tokenizer.json'
  assert kept.stat().st_mtime_ns == before  # Not copied again.
  other = str(tmp_path / 'other.json')
  train_bpe([TEXT * 50], 280, other)
  with pytest.raises(ConfigError, match='differs from it; restore the original'):
    run_tokenizer.check_resumed(tokenizer_lib.load('hf', other), epath.Path(workdir))


def test_a_char_vocabulary_is_kept_and_loaded(tmp_path):
  chars = tokenizer_lib.CharTokenizer(''.join(sorted(set(TEXT))))
  record = run_tokenizer.save(chars, epath.Path(tmp_path))
  assert json.loads((tmp_path / 'tokenizer' / 'chars.json').read_text()) == {'chars': chars.chars}
  loaded = run_tokenizer.load_kept(str(tmp_path), {'tokenizer': record})
  assert loaded.chars == chars.chars and loaded.decode(chars.encode(TEXT)) == TEXT
  assert run_tokenizer.save(tokenizer_lib.ByteTokenizer(), epath.Path(tmp_path)) is None
  assert run_tokenizer.load_kept(str(tmp_path), {}) is None  # An older run: no copy.


def test_a_char_run_needs_its_text_no_more_than_its_kept_vocabulary(tmp_path):
  """A run of data.tokenizer=char on a text file that is gone since: generation and export read
  the kept vocabulary, and only the held-out split asks for the text, in the run's terms."""
  chars = tokenizer_lib.CharTokenizer(''.join(sorted(set(TEXT))))
  saved = json.loads(default_config().to_json())
  saved['data'].update(source='file', tokenizer='char', path=str(tmp_path / 'gone.txt'))
  saved['tokenizer'] = run_tokenizer.save(chars, epath.Path(tmp_path))
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  for reads in (TOKENIZER, VOCABULARY):  # engine.generate's, engine.export's.
    run = assemble_finished_run(str(tmp_path), '1x1x1', reads=reads)
    assert run.tokenizer.chars == chars.chars and run.setup.model.vocab_size >= len(chars.chars)
  with pytest.raises(ConfigError, match=rf"^--workdir={tmp_path}: the run's text, data.path="
                     r"'.*gone.txt', does not exist; the held-out split is read from it"):
    assemble_finished_run(str(tmp_path), '1x1x1', reads=CORPUS)
