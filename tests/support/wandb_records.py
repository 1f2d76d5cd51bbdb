"""What an offline W&B run wrote: the records of its `run-ID.wandb` file, read with W&B's own
protobuf definitions. The file is a LevelDB-style log (a 7-byte file header; 32 KiB blocks of
records, each a 7-byte header (checksum, length, type: full, first, middle, last) and its data),
which the wandb package writes but, since its core moved out of Python, no longer reads."""

import glob
import json
import os
import struct

_BLOCK = 32768
_HEADER = struct.Struct('<IHB')
_FULL, _LAST = 1, 4


def _records(raw: bytes):
  position, parts = _HEADER.size, b''  # The file header is as long as a record header.
  while position + _HEADER.size <= len(raw):
    if _BLOCK - position % _BLOCK < _HEADER.size:  # A block's tail too short for a header.
      position += _BLOCK - position % _BLOCK
      continue
    _, length, kind = _HEADER.unpack_from(raw, position)
    position += _HEADER.size
    parts += raw[position:position + length]
    position += length
    if kind in (_FULL, _LAST):
      yield parts
      parts = b''


def read(run_dir: str) -> dict:
  """{'id', 'project', 'name', 'config': {...}, 'history': [{...}, ...]} of one offline run
  directory (WORKDIR/wandb/offline-run-*)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  (path,) = glob.glob(os.path.join(run_dir, 'run-*.wandb'))
  with open(path, 'rb') as f:
    raw = f.read()
  assert raw[:4] == b':W&B', path
  found = {'history': []}
  for data in _records(raw):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(data)
    kind = record.WhichOneof('record_type')
    if kind == 'run':
      found.update(id=record.run.run_id, project=record.run.project,
                   name=record.run.display_name,
                   config={u.key: json.loads(u.value_json) for u in record.run.config.update})
    elif kind == 'history':
      found['history'].append({i.key or '/'.join(i.nested_key): json.loads(i.value_json)
                               for i in record.history.item})
  return found


def offline_runs(workdir) -> list[str]:
  """The offline run directories under WORKDIR/wandb, oldest first."""
  return sorted(glob.glob(os.path.join(str(workdir), 'wandb', 'offline-run-*')))
