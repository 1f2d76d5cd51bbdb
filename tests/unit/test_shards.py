"""Subword tokenizers, engine.data.prepare's shards and `data.source=shards`: round trips, the stream
read back, per-process slices, exact resume, mixing, and a run that trains on them."""

import json
import re

import numpy as np
import pytest

from engine import data
from engine.data import shards
from engine.data import tokenizers as tokenizer_lib
from engine.errors import ConfigError
from engine.main import run as run_main
from engine.data.shard_writer import pieces, prepare
from engine.data.bpe_trainer import train as train_bpe
from tests.support.helpers import tiny_config

SEQ = 16


@pytest.fixture(scope='module')
def corpus_dir(tmp_path_factory):
  """Three documents of seeded random numbers (no two windows alike), one long enough for
  several pieces."""
  root = tmp_path_factory.mktemp('corpus')
  rng = np.random.default_rng(0)
  for i, words in enumerate([800, 6000, 1200]):
    lines = [' '.join(map(str, rng.integers(0, 2000, 12))) for _ in range(words // 12)]
    (root / f'doc{i}.txt').write_text('\n'.join(lines) + '\n')
  return root


@pytest.fixture(scope='module')
def bpe(corpus_dir, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('bpe') / 'tokenizer.json')
  train_bpe(data.documents(str(corpus_dir)), 300, path)
  return path


def test_subword_tokenizers_round_trip(bpe, corpus_dir, tmp_path):
  import sentencepiece  # pylint: disable=g-import-not-at-top
  sentencepiece.SentencePieceTrainer.train(
      input=str(corpus_dir / 'doc1.txt'), model_prefix=str(tmp_path / 'sp'), vocab_size=60,
      model_type='bpe', minloglevel=2)
  text = 'Shall I compare thee to a summer\'s day? Ünïcödé 🙂\n  indented\n'
  hf = tokenizer_lib.load('hf', bpe)
  ids = hf.encode(text)
  assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < hf.vocab_size == 300
  assert hf.decode(ids) == text  # Byte-level: every text, exactly.
  numbers = '1234 567 1890 12 345\n'
  assert len(hf.encode(numbers)) < len(numbers)  # It learned merges of its corpus.
  assert hf.decode([hf.eos_id]) == '<|endoftext|>'
  sp = tokenizer_lib.load('sentencepiece', str(tmp_path / 'sp.model'))
  plain = '1234 567 1890 12 345'
  assert sp.decode(sp.encode(plain)) == plain and sp.vocab_size == 60 and sp.eos_id is not None
  with pytest.raises(ConfigError, match="is not a hf tokenizer file"):
    tokenizer_lib.load('hf', str(tmp_path / 'sp.model'))


@pytest.fixture(scope='module')
def shard_set(bpe, corpus_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp('shards') / 'set')
  meta = prepare([str(corpus_dir)], 'hf', bpe, out, processes=2, record_tokens=64,
                 records_per_shard=8, piece_bytes=2000)
  return out, meta


def test_shards_read_back_the_token_stream(bpe, corpus_dir, shard_set):
  out, meta = shard_set
  tokenizer = tokenizer_lib.load('hf', bpe)
  expected = []
  for text in data.documents(str(corpus_dir)):  # Pieces cut after a newline, then the separator.
    for piece, _, _ in pieces([text], 2000):
      expected.append(tokenizer.encode(piece))
    expected.append(np.array([tokenizer.eos_id]))
  expected = np.concatenate(expected)
  stream = shards.TokenStream(out)
  assert meta['num_tokens'] == stream.num_tokens == len(expected)
  assert len(meta['shards']) > 1 and meta['dtype'] == 'uint16' and meta['num_documents'] == 3
  np.testing.assert_array_equal(stream.tokens(0, len(expected)), expected)
  np.testing.assert_array_equal(stream.tokens(100, 300), expected[100:300])  # Across records.
  for shard in meta['shards']:
    assert shard['sha256'] == shards.sha256(f'{out}/{shard["file"]}')
  windows = shards.PackedWindows(stream, SEQ)
  np.testing.assert_array_equal(windows[3], expected[3 * SEQ:4 * SEQ + 1])


def _data_config(shard_spec, batch=8):
  config = tiny_config().data
  config.source, config.shards, config.seq_len, config.global_batch_size = (
      'shards', shard_spec, SEQ, batch)
  config.tokenizer = 'hf'
  return config


def test_processes_read_disjoint_slices_covering_the_train_windows(shard_set):
  out, _ = shard_set
  config = _data_config(out)
  corpus = data.load_corpus(config, 0)
  windows = shards.PackedWindows(corpus.shard_sets[0][0], SEQ)
  train_windows = int(len(windows) * 0.9)
  epoch = train_windows // 8  # Global batches of 8 that one pass over the windows fills.
  seen = []
  for process in (0, 1):
    rows = data.batches(corpus, config, 'train', 8, 0, process, 2)
    seen.append([tuple(row) for i in range(epoch) for row in rows[i]])
  assert not set(seen[0]) & set(seen[1])
  everything = {tuple(windows[i]) for i in range(train_windows)}
  assert set(seen[0]) | set(seen[1]) <= everything
  assert len(set(seen[0]) | set(seen[1])) == epoch * 8  # Every row a different window.
  # The processes' rows together are exactly the one-process stream.
  single = data.batches(corpus, config, 'train', 8, 0, 0, 1)
  for i in range(epoch):
    np.testing.assert_array_equal(np.concatenate([data.batches(corpus, config, 'train', 8, 0, p,
                                                               2)[i] for p in (0, 1)]),
                                  single[i])


def test_iterator_resumes_mid_shard_exactly(shard_set):
  out, _ = shard_set
  config = _data_config(out)
  corpus = data.load_corpus(config, 0)
  iterator = data.train_iterator(corpus, config, 0)
  for _ in range(5):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(4)]
  resumed = data.train_iterator(corpus, config, 0)
  resumed.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(resumed), want)


def test_mixing_follows_the_weights(shard_set, bpe, tmp_path):
  out, _ = shard_set
  other = str(tmp_path / 'other')
  (tmp_path / 'b.txt').write_text('zebra quagga okapi\n' * 400)
  prepare([str(tmp_path / 'b.txt')], 'hf', bpe, other, processes=1, record_tokens=64)
  config = _data_config(f'{out}:3,{other}:1')
  corpus = data.load_corpus(config, 0)
  assert [w for _, w in corpus.shard_sets] == [0.75, 0.25]
  windows_b = shards.PackedWindows(corpus.shard_sets[1][0], SEQ)
  other_windows = {tuple(windows_b[i]) for i in range(len(windows_b))}
  rows = data.batches(corpus, config, 'train', 8, 0, 0, 1)
  drawn = [tuple(row) for i in range(50) for row in rows[i]]
  share = sum(row in other_windows for row in drawn) / len(drawn)
  assert share == pytest.approx(0.25, abs=0.05)


@pytest.mark.slow
def test_training_on_shards_and_bad_shard_settings(shard_set, tmp_path):
  out, meta = shard_set
  workdir = tmp_path / 'run'
  argv = ['--config=experiments/tiny.py', f'--workdir={workdir}', '--config.mesh.data=8',
          '--config.data.source=shards', f'--config.data.shards={out}', '--config.data.seq_len=16',
          '--config.data.tokenizer=hf',
          '--config.train.num_steps=2', '--config.train.eval_batches=1']
  assert run_main(argv) == 0
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['data']['shards'] == out
  with pytest.raises(ConfigError, match='holds no meta.json'):
    data.load_corpus(_data_config(str(tmp_path)), 0)
  with pytest.raises(ConfigError, match='weight -1'):
    shards.parse_sets(f'{out}:-1')


def test_a_meta_json_naming_a_file_outside_its_set_is_refused(shard_set, tmp_path):
  import shutil  # pylint: disable=g-import-not-at-top
  copy = tmp_path / 'set'
  shutil.copytree(shard_set[0], copy)
  meta = json.loads((copy / 'meta.json').read_text())
  shutil.copy(copy / meta['shards'][0]['file'], tmp_path / 'elsewhere.arrayrecord')
  for name, message in (('../elsewhere.arrayrecord', 'resolves outside'),
                        (str(tmp_path / 'elsewhere.arrayrecord'), 'is not a file name inside')):
    meta['shards'][0]['file'] = name
    (copy / 'meta.json').write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=f"meta.json names {re.escape(repr(name))}, which "
                       f'{message}'):
      shards.TokenStream(str(copy))
