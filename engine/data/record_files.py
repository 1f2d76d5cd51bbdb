"""Documents kept as records, read with pyarrow and streamed (a batch of records at a time, never
the whole file): JSON lines (`.jsonl`, `.ndjson`, `.json`), Parquet (`.parquet`), and a Hugging
Face `datasets` directory written by `save_to_disk` (its Arrow files, memory-mapped).

Each record's `field` is one document (`texts`), or a conversation's list of {role, content}
messages (`conversations`, engine/data/chat.py). `check` refuses, before anything is read in
full, a file whose records lack the field (naming the fields they have); a record whose field is
null or of another type is refused naming the record.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from engine.errors import ConfigError

_SUFFIXES = {'.jsonl': 'jsonl', '.ndjson': 'jsonl', '.json': 'jsonl', '.parquet': 'parquet'}
# pyarrow reads JSON lines in blocks of this size (several tens ahead: memory), up to the limit
# for one line.
_JSON_BLOCK_BYTES = 1 << 20
_JSON_BLOCK_LIMIT = 1 << 30
_BATCH_RECORDS = 1024
# A conversation as JSON lines are read: its messages' roles and contents (other keys ignored).
MESSAGES = pa.list_(pa.struct([('role', pa.string()), ('content', pa.string())]))


def is_datasets_directory(path: str) -> bool:
  """True for a directory `datasets.Dataset.save_to_disk` wrote (or a DatasetDict's)."""
  return os.path.isdir(path) and (
      os.path.isfile(os.path.join(path, 'state.json')) or
      os.path.isfile(os.path.join(path, 'dataset_dict.json')))


def kind_of(path: str) -> str | None:
  """'jsonl', 'parquet' or 'datasets' for a record file or directory; None for text."""
  if is_datasets_directory(path):
    return 'datasets'
  return _SUFFIXES.get(os.path.splitext(path)[1].lower())


def _arrow_files(path: str, what: str) -> list[str]:
  if os.path.isfile(os.path.join(path, 'dataset_dict.json')):
    with open(os.path.join(path, 'dataset_dict.json')) as f:
      splits = json.load(f).get('splits', [])
    example = os.path.join(path, (splits or ['train'])[0])
    raise ConfigError(f'{what} holds a DatasetDict (splits {", ".join(map(repr, splits))}); pass '
                      f'one split\'s directory, e.g. --input={example}.')
  with open(os.path.join(path, 'state.json')) as f:
    names = [entry['filename'] for entry in json.load(f).get('_data_files', [])]
  missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
  if not names or missing:
    raise ConfigError(f'{what} is a datasets directory without its data file '
                      f'{(missing or ["(none listed)"])[0]!r}; save it again with save_to_disk.')
  return [os.path.join(path, n) for n in names]


def _first_json_record(path: str, what: str) -> dict:
  with open(path, 'rb') as f:
    for number, line in enumerate(f, 1):
      if line.strip():
        try:
          record = json.loads(line)
        except ValueError as e:
          raise ConfigError(f'{what} is not JSON lines: line {number} does not parse ({e}); '
                            'pass one JSON object per line.') from None
        if not isinstance(record, dict):
          raise ConfigError(f'{what} is not JSON lines of objects: line {number} is a '
                            f'{type(record).__name__}; pass one JSON object per line.')
        return record
  return {}


def field_names(path: str, kind: str, what: str) -> list[str] | None:
  """The fields of the file's records (a JSON lines file's first record's); None when it has
  no records."""
  if kind == 'jsonl':
    record = _first_json_record(path, what)
    return list(record) if record else None
  if kind == 'parquet':
    try:
      return pq.ParquetFile(path).schema_arrow.names
    except pa.ArrowException as e:
      raise ConfigError(f'{what} is not a Parquet file ({e}); pass a .parquet file.') from None
  with pa.memory_map(_arrow_files(path, what)[0]) as source:
    return pa.ipc.open_stream(source).schema.names


def check(path: str, kind: str, field: str, what: str, flag: str) -> None:
  """Refuses a record file whose records lack `field` (which `flag` sets)."""
  names = field_names(path, kind, what)
  if names is not None and field not in names:
    raise ConfigError(f'{what} has no field {field!r} (its records have '
                      f'{", ".join(map(repr, names)) or "no fields"}); pass {flag}=the field that '
                      'holds the text.')



def _json_batches(path: str, field: str, value_type=pa.string()):
  """A JSON lines file's field, a block of lines at a time. pyarrow's reader reads ahead, some
  tens of blocks, so blocks are small; a line longer than one makes the reader start again with
  blocks 16 times as long, past the records already given."""
  given, block = 0, _JSON_BLOCK_BYTES
  while True:
    reader = pa_json.open_json(
        path, read_options=pa_json.ReadOptions(block_size=block),
        parse_options=pa_json.ParseOptions(explicit_schema=pa.schema([(field, value_type)]),
                                           unexpected_field_behavior='ignore'))
    skip = given
    try:
      for batch in reader:
        column = batch.column(0)[skip:]
        skip = max(0, skip - len(batch))
        given += len(column)
        yield column
      return
    except pa.ArrowInvalid as e:
      if 'straddl' not in str(e) or block >= _JSON_BLOCK_LIMIT:
        raise
      block *= 16


def _batches(path: str, kind: str, field: str, what: str, value_type=pa.string()):
  """The field's values, a pyarrow array per batch of records (JSON lines read as
  `value_type`)."""
  if kind == 'jsonl':
    yield from _json_batches(path, field, value_type)
  elif kind == 'parquet':
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH_RECORDS, columns=[field]):
      yield batch.column(0)
  else:
    for arrow_file in _arrow_files(path, what):
      with pa.memory_map(arrow_file) as source:
        for batch in pa.ipc.open_stream(source):
          yield batch.column(field)


def texts(path: str, kind: str, field: str, what: str, flag: str):
  """Each record's `field`, in order: one document per record (after `check`)."""
  for number, value in _values(path, kind, field, what, pa.string()):
    if not isinstance(value, str):
      raise ConfigError(f'{what}: field {field!r} of record {number} holds '
                        f'{type(value).__name__}, not text; pass {flag}=a field of strings.')
    yield value


def conversations(path: str, kind: str, field: str, what: str):
  """(record number, its `field`) of each record (after `check`): a conversation's messages, not
  yet checked to be messages (engine/data/chat.py: messages_of)."""
  yield from _values(path, kind, field, what, MESSAGES)


def _values(path: str, kind: str, field: str, what: str, value_type):
  """(record number, value) of each record's `field`; the file is `check`ed already."""
  number = 0
  try:
    for column in _batches(path, kind, field, what, value_type):
      for value in column.to_pylist():
        number += 1
        if value is None:
          raise ConfigError(f'{what}: record {number} has no {field!r} (missing or null); fill '
                            'it in or drop the record.')
        yield number, value
  except pa.ArrowException as e:
    raise ConfigError(f'{what} cannot be read at or after record {number + 1}: '
                      f'{str(e).splitlines()[0]}; fix the file (one JSON object per line, each '
                      'under 1 GiB; a messages field a list of {"role", "content"} strings).'
                      ) from None
