"""JSON lines, Parquet and `datasets` directories as inputs of the data commands
(engine/data/record_files.py): the same documents give the same shard set as text files, read a
batch at a time, and each way a record file can be wrong is one line naming the fix.

tests/support/datasets_dir was written by the `datasets` package itself
(`datasets.Dataset.from_list(rows).save_to_disk(...)`, rows {'text', 'source'} as in TEXTS).
"""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.data import record_files
from engine.data import shard_writer
from engine.data import shards
from engine.data import sources
from engine.errors import ConfigError

DATASETS_DIR = os.path.join(os.path.dirname(__file__), '..', 'support', 'datasets_dir')
TEXTS = ['First document.\nIt has two lines.', 'Second: ünïcode and tabs\there.', 'Third.']


def _write_jsonl(path, rows):
  with open(path, 'w') as f:
    f.writelines(json.dumps(row) + '\n' for row in rows)


@pytest.fixture
def record_inputs(tmp_path):
  """The same three documents as text files, JSON lines (field `body`), Parquet (two row groups)
  and the `datasets` directory."""
  text_dir = tmp_path / 'text'
  text_dir.mkdir()
  for i, text in enumerate(TEXTS):
    (text_dir / f'{i}.txt').write_text(text)
  _write_jsonl(tmp_path / 'docs.jsonl', [{'id': i, 'body': t} for i, t in enumerate(TEXTS)])
  pq.write_table(pa.table({'body': TEXTS, 'id': [0, 1, 2]}), tmp_path / 'docs.parquet',
                 row_group_size=2)
  return tmp_path, str(text_dir)


def test_every_format_reads_the_same_documents(record_inputs):
  root, text_dir = record_inputs
  assert list(sources.documents(text_dir)) == TEXTS
  assert list(sources.documents(str(root / 'docs.jsonl'), 'body')) == TEXTS
  assert list(sources.documents(str(root / 'docs.parquet'), 'body')) == TEXTS
  assert list(sources.documents(DATASETS_DIR)) == TEXTS
  # A directory holding a datasets directory reads it whole (not its .arrow file as text).
  mixed = root / 'mixed'
  os.makedirs(mixed / 'nested')
  os.symlink(os.path.abspath(DATASETS_DIR), mixed / 'nested' / 'saved')
  (mixed / 'a.txt').write_text('plain')
  assert list(sources.documents(str(mixed))) == ['plain'] + TEXTS


def test_a_shard_set_from_records_equals_the_one_from_text_files(record_inputs, tmp_path,
                                                                 monkeypatch):
  root, text_dir = record_inputs
  monkeypatch.setattr(shard_writer, '_WINDOW_PIECES', 1)  # Several windows in flight.
  reference = shard_writer.prepare([text_dir], 'byte', '', str(tmp_path / 'from_text'),
                                   processes=2, record_tokens=8, piece_bytes=12)
  for name, inputs in (('jsonl', [str(root / 'docs.jsonl')]),
                       ('parquet', [str(root / 'docs.parquet')])):
    meta = shard_writer.prepare(inputs, 'byte', '', str(tmp_path / name), processes=2,
                                record_tokens=8, piece_bytes=12, text_field='body')
    assert (meta['num_tokens'], meta['num_documents'], meta['input_bytes']) == (
        reference['num_tokens'], 3, reference['input_bytes'])
    np.testing.assert_array_equal(
        shards.TokenStream(str(tmp_path / name)).tokens(0, meta['num_tokens']),
        shards.TokenStream(str(tmp_path / 'from_text')).tokens(0, meta['num_tokens']))
  meta = shard_writer.prepare([DATASETS_DIR], 'byte', '', str(tmp_path / 'datasets'), processes=1,
                              record_tokens=8)
  assert meta['num_tokens'] == reference['num_tokens']


def test_records_are_read_a_batch_at_a_time(tmp_path, monkeypatch):
  """The first documents arrive before a broken record far down the file is read."""
  monkeypatch.setattr(record_files, '_JSON_BLOCK_BYTES', 1024)
  path = tmp_path / 'long.jsonl'
  _write_jsonl(path, [{'text': f'document {i} ' + 'x' * 80} for i in range(200)])
  with open(path, 'a') as f:
    f.write('{"text": 17}\n')
  stream = sources.stream_inputs([str(path)])
  assert next(stream).startswith('document 0 ')
  with pytest.raises(ConfigError, match=r"cannot be read at or after record (19\d|20\d)"):
    list(stream)


def test_a_line_longer_than_a_block_is_read_with_longer_blocks(tmp_path, monkeypatch):
  monkeypatch.setattr(record_files, '_JSON_BLOCK_BYTES', 1024)
  lengths = [100] * 30 + [40_000] + [100] * 30  # The long one needs blocks of 64 KiB.
  _write_jsonl(tmp_path / 'a.jsonl', [{'text': 'x' * n} for n in lengths])
  assert [len(t) for t in sources.stream_inputs([str(tmp_path / 'a.jsonl')])] == lengths


@pytest.mark.parametrize('name, content, flag, message', [
    ('a.jsonl', '{"body": "x"}\n', 'text',
     r"has no field 'text' \(its records have 'body'\); pass --text_field=the field that holds"),
    ('b.jsonl', '{"text": "x"}\n{"id": 2}\n', 'text',
     r"record 2 has no 'text' \(missing or null\); fill it in or drop the record"),
    ('c.jsonl', '["text"]\n', 'text', r'is not JSON lines of objects: line 1 is a list'),
    ('d.jsonl', '{"text": \n', 'text', r'is not JSON lines: line 1 does not parse'),
    ('e.parquet', 'not parquet', 'text', r'is not a Parquet file'),
])
def test_each_broken_record_file_is_one_line(tmp_path, name, content, flag, message):
  (tmp_path / name).write_text(content)
  with pytest.raises(ConfigError, match=message):
    list(sources.stream_inputs([str(tmp_path / name)], flag))


def test_a_parquet_field_of_numbers_and_a_dataset_dict_are_refused(tmp_path):
  pq.write_table(pa.table({'text': [1, 2]}), tmp_path / 'n.parquet')
  with pytest.raises(ConfigError, match=r"field 'text' of record 1 holds int, not text"):
    list(sources.stream_inputs([str(tmp_path / 'n.parquet')]))
  (tmp_path / 'dict').mkdir()
  (tmp_path / 'dict' / 'dataset_dict.json').write_text('{"splits": ["train", "test"]}')
  with pytest.raises(ConfigError, match=r"holds a DatasetDict \(splits 'train', 'test'\); pass "
                     r"one split's directory, e\.g\. --input=.*dict/train\."):
    sources.stream_inputs([str(tmp_path / 'dict')])


def test_a_missing_field_is_refused_before_anything_is_written(tmp_path):
  _write_jsonl(tmp_path / 'a.jsonl', [{'body': 'x'}])
  with pytest.raises(ConfigError, match="has no field 'text'"):
    shard_writer.prepare([str(tmp_path / 'a.jsonl')], 'byte', '', str(tmp_path / 'out'))
  assert sorted(os.listdir(tmp_path)) == ['a.jsonl']
