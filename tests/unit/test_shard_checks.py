"""Shard sets checked against their own meta.json and the run (engine/data/shard_meta.py), and
the data commands' bad inputs (engine.data.prepare, engine.data.train_tokenizer): each a
ConfigError of one line, nothing written."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engine import data
from engine.errors import ConfigError
from engine.data import shards
from engine.data.shard_writer import prepare
from engine.data.bpe_trainer import train as train_bpe
from engine.config import with_values
from engine.workdir import run_dir, shard_sets
from tests.support.helpers import tiny_config


@pytest.fixture(scope='module')
def text(tmp_path_factory):
  rng = np.random.default_rng(1)
  path = tmp_path_factory.mktemp('text') / 'a.txt'
  path.write_text('\n'.join(' '.join(map(str, rng.integers(0, 900, 10))) for _ in range(300)))
  return path


@pytest.fixture(scope='module')
def bpe(text, tmp_path_factory):
  path = str(tmp_path_factory.mktemp('bpe') / 'tokenizer.json')
  train_bpe([text.read_text()], 300, path)
  return path


@pytest.fixture(scope='module')
def sets(text, bpe, tmp_path_factory):
  """A byte set and a BPE set of the same text, 64 tokens a record, 4 records a shard."""
  root = tmp_path_factory.mktemp('sets')
  for kind, path in (('byte', ''), ('hf', bpe)):
    prepare([str(text)], kind, path, str(root / kind), processes=1, record_tokens=64,
            records_per_shard=4)
  return root


def _copy(sets, kind, tmp_path, edit=None):
  """A copy of the `kind` set, its meta.json passed through `edit`."""
  copy = tmp_path / kind
  shutil.copytree(sets / kind, copy)
  if edit:
    meta = json.loads((copy / 'meta.json').read_text())
    edit(meta)
    (copy / 'meta.json').write_text(json.dumps(meta))
  return copy


def _config(directory, tokenizer='byte', tokenizer_path=''):
  config = tiny_config().data
  config.source, config.shards, config.seq_len = 'shards', str(directory), 16
  config.tokenizer, config.tokenizer_path = tokenizer, tokenizer_path
  return config


def _set(meta, key, value):
  meta[key] = value


def _shard_tokens(meta, tokens):
  """Shard 0 holding `tokens`, num_tokens following (a count that is consistent, but wrong)."""
  meta['num_tokens'] += tokens - meta['shards'][0]['tokens']
  meta['shards'][0]['tokens'] = tokens


@pytest.mark.parametrize('edit, message', [
    (lambda m: _set(m, 'num_tokens', m['num_tokens'] // 3), r'records num_tokens=\d+, but its '
     r'shards hold \d+ tokens; rerun python -m engine.data.prepare'),
    (lambda m: m.pop('record_tokens'), "meta.json lacks 'record_tokens'; rerun"),
    (lambda m: _set(m, 'num_tokens', 'many'), "has an invalid 'num_tokens' \\('many'\\)"),
    (lambda m: _set(m, 'shards', []), r"has an invalid 'shards' \(\[\]\)"),
    (lambda m: m['shards'][0].pop('sha256'), "lacks 'sha256' for shard 0"),
    (lambda m: _shard_tokens(m, 10), r'records 10 tokens in 4 records for shard 0'),
    (lambda m: _set(m, 'record_tokens', 32), r'records \d+ tokens in 4 records for shard 0'),
    (lambda m: _set(m['tokenizer'], 'vocab_size', 300), 'byte tokenizer with vocab_size 300'),
    (lambda m: _set(m, 'dtype', 'uint32'), 'records dtype uint32 for a vocabulary of 256'),
    (lambda m: _set(m['shards'][1], 'max_id', 256), 'records token id 256 in '
     "'tokens-00001.arrayrecord', outside the vocabulary of 256"),
    (lambda m: _set(m['shards'][1], 'bytes', 5), r'tokens-00001.arrayrecord holds \d+ bytes, but '
     'meta.json records 5'),
])
def test_a_meta_json_that_disagrees_with_itself_or_its_files_is_one_line(sets, tmp_path, edit,
                                                                         message):
  copy = _copy(sets, 'byte', tmp_path, edit)
  with pytest.raises(ConfigError, match=message) as error:
    shards.TokenStream(str(copy))
  assert '\n' not in str(error.value) and str(error.value).startswith('data.shards: ')


@pytest.mark.parametrize('content, message', [
    ('{"format": "engine-token-shards/1", ', 'is not JSON'), ('[1, 2]', 'holds a JSON list'),
    (b'\xff\xfe', 'is not JSON')])
def test_a_meta_json_that_is_not_json_is_one_line(sets, tmp_path, content, message):
  copy = _copy(sets, 'byte', tmp_path)
  (copy / 'meta.json').write_bytes(content if isinstance(content, bytes) else content.encode())
  with pytest.raises(ConfigError, match=f'meta.json {message}.*rerun python -m '
                     'engine.data.prepare'):
    shards.TokenStream(str(copy))


def test_damaged_shard_files_are_refused_naming_the_file(sets, tmp_path):
  copy = _copy(sets, 'byte', tmp_path)
  file = copy / 'tokens-00001.arrayrecord'
  raw = bytearray(file.read_bytes())
  file.write_bytes(raw[:len(raw) // 2])  # Truncated: the size recorded at prepare differs.
  with pytest.raises(ConfigError, match='tokens-00001.arrayrecord holds .* bytes, but meta.json'):
    shards.TokenStream(str(copy))
  raw[len(raw) // 2] ^= 0xff  # Same size, other bytes: the checksum, at the file's first read.
  file.write_bytes(raw)
  stream = shards.TokenStream(str(copy))
  np.testing.assert_array_equal(stream.tokens(0, 64), shards.TokenStream(
      str(sets / 'byte')).tokens(0, 64))  # Shard 0 reads.
  with pytest.raises(ConfigError, match=re.escape(f'{file} does not match the SHA-256 that '
                                                  'meta.json records for it')):
    stream.tokens(4 * 64, 4 * 64 + 10)


def test_ids_outside_the_vocabulary_are_refused_on_open_and_on_read(sets, tmp_path):
  def shrink(meta, keep_max=True):
    meta['tokenizer']['vocab_size'] = 100
    for shard in meta['shards']:
      if not keep_max:
        shard.pop('max_id')
  with pytest.raises(ConfigError, match="records token id .* outside the vocabulary of 100"):
    shards.TokenStream(str(_copy(sets, 'hf', tmp_path / 'a', shrink)))
  # A set from before max_id was recorded: the first record read with such an id.
  stream = shards.TokenStream(str(_copy(sets, 'hf', tmp_path / 'b', lambda m: shrink(m, False))))
  with pytest.raises(ConfigError, match=r'record 0 of .*tokens-00000.arrayrecord holds token id '
                     r'\d+, outside the vocabulary of 100 \(meta.json\); rerun'):
    stream.tokens(0, 10)


def test_the_run_must_name_the_tokenizer_the_set_was_written_with(sets, bpe, text, tmp_path):
  with pytest.raises(ConfigError, match="was written with the hf tokenizer, but data.tokenizer="
                     "'byte'; pass --config.data.tokenizer=hf"):
    data.load_corpus(_config(sets / 'hf'), 0)
  corpus = data.load_corpus(_config(sets / 'hf', 'hf'), 0)  # The recorded file decodes.
  assert corpus.tokenizer.path == os.path.abspath(bpe) and corpus.tokenizer.vocab_size == 300
  # Byte shards whose meta.json names the BPE: the run's byte tokenizer does not match it.
  def name_bpe(meta):
    meta['tokenizer'] = json.loads((sets / 'hf' / 'meta.json').read_text())['tokenizer']
  relabelled = _copy(sets, 'byte', tmp_path / 'a', name_bpe)
  with pytest.raises(ConfigError, match="written with the hf tokenizer, but data.tokenizer='byte'"):
    data.load_corpus(_config(relabelled), 0)
  # ... and with the data.tokenizer=hf that refusal suggests: byte ids do not decode to the text
  # the set recorded, so they never train as BPE ids.
  with pytest.raises(ConfigError, match="holds ids that tokenizer .* does not decode to the text "
                     "they were written from .*; rerun python -m engine.data.prepare"):
    data.load_corpus(_config(relabelled, 'hf'), 0)
  # BPE shards relabelled as bytes pass the vocabulary checks only where every id is below 256.
  with pytest.raises(ConfigError, match='outside the vocabulary of 256|does not decode'):
    data.load_corpus(_config(_copy(sets, 'hf', tmp_path / 'c', lambda m: m.update(
        tokenizer=json.loads((sets / 'byte' / 'meta.json').read_text())['tokenizer'],
        dtype='uint16'))), 0)
  other = str(tmp_path / 'other.json')
  train_bpe([text.read_text()[::-1]], 300, other)
  with pytest.raises(ConfigError, match=re.escape(f'tokenizer {other} (data.tokenizer_path) is '
                                                  'not the tokenizer')):
    data.load_corpus(_config(sets / 'hf', 'hf', other), 0)
  # The recorded file replaced since prepare: refused, not decoded with.
  moved = str(tmp_path / 'moved.json')
  shutil.copy(bpe, moved)
  prepare([str(text)], 'hf', moved, str(tmp_path / 'set'), processes=1, record_tokens=64)
  shutil.copy(other, moved)
  with pytest.raises(ConfigError, match=re.escape(f'tokenizer {moved} (its meta.json) is not')):
    data.load_corpus(_config(tmp_path / 'set', 'hf'), 0)
  # A meta.json without the file's SHA-256 (as older sets were written): the vocabulary and ids decide.
  old = _copy(sets, 'hf', tmp_path / 'b', lambda m: m['tokenizer'].pop('sha256'))
  assert data.load_corpus(_config(old, 'hf', bpe), 0).tokenizer.path == bpe
  train_bpe([text.read_text()], 280, other)
  with pytest.raises(ConfigError, match=r'vocabulary, end- and beginning-of-text ids \(280'):
    data.load_corpus(_config(old, 'hf', other), 0)


def test_a_set_written_again_under_a_run_is_refused_on_resume(text, tmp_path):
  """The workdir records each set's identity: a resume on a set written again from other text
  is refused naming it; written again from the same text, it resumes."""
  out, workdir = tmp_path / 'set', run_dir.resolve(str(tmp_path / 'run'))
  workdir.mkdir()
  _prepare([text], out)
  config = with_values(tiny_config(), {'data.source': 'shards', 'data.shards': str(out),
                                       'data.seq_len': 16, 'data.tokenizer': 'byte'})
  corpus = data.load_corpus(config.data, 0)
  run_dir.write_config(config, workdir, shard_sets=shard_sets.record(corpus))
  _prepare([text], out, overwrite=True)  # The same text again: the same data.
  shard_sets.check_resumed(data.load_corpus(config.data, 0), workdir)
  other = tmp_path / 'other.txt'
  other.write_text(text.read_text()[::-1])
  _prepare([other], out, overwrite=True)
  with pytest.raises(ConfigError, match=re.escape(f"data.shards: '{out}' was written again since "
                                                  f'--workdir={workdir} trained on it')):
    shard_sets.check_resumed(data.load_corpus(config.data, 0), workdir)
  assert 'shard_sets' not in run_dir.read_run_config(str(workdir))  # The config alone.


@pytest.mark.parametrize('weight', ['nan', 'inf', '-inf', '0'])
def test_mixing_weights_must_be_finite_and_positive(weight):
  with pytest.raises(ConfigError, match=f'weight {weight} of .* must be a finite number > 0'):
    shards.parse_sets(f'/a:1,/b:{weight}')


def _prepare(inputs, out, **kwargs):
  kwargs = dict(dict(kind='byte', path='', processes=1, record_tokens=64), **kwargs)
  return prepare([str(i) for i in inputs], out=str(out), **kwargs)


def test_prepare_refuses_bad_inputs_before_writing(text, tmp_path):
  (tmp_path / 'empty.txt').write_text('')
  (tmp_path / 'empty_dir').mkdir()
  (tmp_path / 'a_file').write_text('x')
  (tmp_path / 'other').mkdir()
  (tmp_path / 'other' / 'notes.txt').write_text('x')
  out = tmp_path / 'out'
  for inputs, kwargs, message in (
      ([tmp_path / 'empty.txt'], {}, "empty.txt' is empty: there is no text to tokenize"),
      ([text, tmp_path / 'empty_dir'], {}, "empty_dir' holds no files: there is no text"),
      ([tmp_path / 'nope'], {}, "nope' is neither a file, a directory"),
      ([text], {'kind': 'hf'}, '--tokenizer=hf reads --tokenizer_path, but none is given'),
      ([text], {'record_tokens': 0}, r'--record_tokens=0 must be >= 1\.'),
      ([text], {'records_per_shard': 0}, r'--records_per_shard=0 must be >= 1\.'),
      ([text], {'processes': -1}, r'--processes=-1 must be >= 0 \(0: one per core\)\.'),
      ([text], {'out': tmp_path / 'a_file'}, "a_file' is a file; pass a new directory"),
      ([text], {'out': tmp_path / 'a_file' / 'set'}, "lies under .*a_file', which is a file"),
      ([text], {'out': tmp_path / 'other'}, r"other' holds other files \('notes.txt', \.\.\.\)")):
    with pytest.raises(ConfigError, match=message):
      _prepare(inputs, **dict(dict(out=out), **kwargs))
    assert not out.exists() and not list(tmp_path.glob('*.tmp-*'))
  assert sorted(os.listdir(tmp_path / 'other')) == ['notes.txt']


def test_prepare_replaces_a_set_only_when_told_and_never_leaves_half_a_set(text, tmp_path,
                                                                             monkeypatch):
  out = tmp_path / 'set'
  first = _prepare([text], out)
  with pytest.raises(ConfigError, match="already holds a shard set .*; pass --overwrite"):
    _prepare([text], out, record_tokens=32)
  assert json.loads((out / 'meta.json').read_text()) == first
  second = _prepare([text], out, record_tokens=32, overwrite=True)
  assert shards.TokenStream(str(out)).record_tokens == 32 == second['record_tokens']
  assert sorted(os.listdir(tmp_path)) == ['set']  # Nothing left beside it.
  umask = os.umask(0)
  os.umask(umask)
  assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask  # Not mkdtemp's private mode.

  def fail(*args):
    raise OSError('disk full')
  monkeypatch.setattr(shards.Writer, 'close', fail)
  with pytest.raises(OSError, match='disk full'):
    _prepare([text], tmp_path / 'new')
  with pytest.raises(OSError, match='disk full'):
    _prepare([text], out, overwrite=True)
  assert sorted(os.listdir(tmp_path)) == ['set']  # No half set, the old set kept.
  assert json.loads((out / 'meta.json').read_text()) == second


def test_train_tokenizer_refuses_too_little_text_and_bad_outs(tmp_path):
  out = tmp_path / 'bpe.json'
  with pytest.raises(ConfigError, match=r'--vocab_size=300: the input yields only 2\d\d tokens; '
                     r'pass more text or a --vocab_size of at most 2\d\d\.'):
    train_bpe(['hello world\n'], 300, str(out), exact=True)
  with pytest.raises(ConfigError, match="is a directory; pass a file path"):
    train_bpe(['hello world\n'], 260, str(tmp_path))
  with pytest.raises(ConfigError, match="nodir is not a directory; create it"):
    train_bpe(['hello world\n'], 260, str(tmp_path / 'nodir' / 'bpe.json'))
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_the_data_commands_report_bad_flags_in_one_line(text, tmp_path):
  """Through the command line: the flags reach the checks, exit 2, nothing written."""
  out = tmp_path / 'set'
  runs = [(['engine.data.prepare', f'--input={text}', '--tokenizer=byte', f'--out={out}',
            '--processes=1'], 0, ''),
          (['engine.data.prepare', f'--input={text}', '--tokenizer=byte', f'--out={out}'], 2,
           f"error: --out={str(out)!r} already holds a shard set (or part of one); pass "
           '--overwrite to replace it, or another --out.\n'),
          (['engine.data.train_tokenizer', f'--input={text}', '--vocab_size=100000',
            f'--out={tmp_path / "bpe.json"}'], 2, 'error: --vocab_size=100000: the input yields '
           'only ')]
  for argv, status, stderr in runs:
    result = subprocess.run([sys.executable, '-m'] + argv, capture_output=True, text=True,
                            env=dict(os.environ, JAX_PLATFORMS='cpu'), check=False)
    assert result.returncode == status, result.stderr
    if status:
      assert result.stderr.startswith(stderr) and result.stderr.count('\n') == 1
  assert sorted(os.listdir(tmp_path)) == ['set']
