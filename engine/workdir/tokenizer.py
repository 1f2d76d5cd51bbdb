"""The run's tokenizer kept in its workdir, so that a finished run needs no file outside it.

When a run starts (after validation and the workdir lock), process 0 copies the tokenizer it
trains with into WORKDIR/tokenizer/:

  tokenizer.json   data.tokenizer=hf: the file itself (data.tokenizer_path, or for shards the
                   one their meta.json names)
  tokenizer.model  data.tokenizer=sentencepiece: the file itself
  chars.json       data.tokenizer=char: the vocabulary, {"chars": the corpus's sorted characters}

and config.json records it under `tokenizer`: its kind, the file relative to the workdir and the
file's SHA-256. A byte tokenizer needs no file. Generation, evaluation and export
(engine.assemble.assemble_finished_run) load the copy, checked against that record (a shard set
read for evaluation checks it against its meta.json too). Workdirs without a copy (older runs)
load the tokenizer their config.json names, as before.

On resume the copy is the truth: it is not copied again, and a run whose tokenizer differs from
it is refused.
"""

from __future__ import annotations

import hashlib
import json
import tempfile

import jax
from etils import epath

from engine.workdir import run_dir as workdir_lib
from engine.errors import ConfigError
from engine.data import tokenizers

DIRECTORY = 'tokenizer'
FILES = {'hf': 'tokenizer.json', 'sentencepiece': 'tokenizer.model', 'char': 'chars.json'}
CONFIG_KEY = 'tokenizer'  # config.json's record of the copy.


def content(tokenizer) -> bytes | None:
  """What the workdir keeps of `tokenizer`: its file's bytes, the char vocabulary as JSON, or
  None (bytes need nothing)."""
  if tokenizer.kind == 'char' and hasattr(tokenizer, 'chars'):
    return json.dumps({'chars': tokenizer.chars}).encode('utf-8')
  if tokenizer.kind in ('hf', 'sentencepiece') and getattr(tokenizer, 'path', ''):
    return epath.Path(tokenizer.path).read_bytes()
  return None


def _where(tokenizer) -> str:
  return 'the corpus\'s characters' if tokenizer.kind == 'char' else tokenizer.path


def check_resumed(tokenizer, workdir: epath.Path) -> None:
  """Refuses to resume a run whose tokenizer differs from the copy its workdir keeps."""
  kept = workdir / DIRECTORY / FILES.get(tokenizer.kind, '')
  if tokenizer.kind not in FILES or not kept.exists():
    return  # Bytes, or a run from before the copy.
  if kept.read_bytes() != content(tokenizer):
    raise ConfigError(
        f'--workdir={workdir} holds a run that started with the tokenizer kept in {kept}, and '
        f'this run\'s {tokenizer.kind} tokenizer ({_where(tokenizer)}) differs from it; restore '
        f'the original (a copy is {kept}), or use a new --workdir.')


def save(tokenizer, workdir: epath.Path) -> dict | None:
  """Copies `tokenizer` into the workdir (process 0; not again when the copy is there) and
  returns config.json's record of it (None for bytes)."""
  data = content(tokenizer)
  if data is None:
    return None
  name = f'{DIRECTORY}/{FILES[tokenizer.kind]}'
  kept = workdir / name
  if jax.process_index() == 0 and not (kept.exists() and kept.read_bytes() == data):
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = kept.parent / f'{kept.name}.tmp'
    tmp.write_bytes(data)
    tmp.replace(kept)  # Whole or not at all.
  return {'kind': tokenizer.kind, 'file': name, 'sha256': hashlib.sha256(data).hexdigest()}


def load_kept(workdir: str, saved: dict):
  """The tokenizer a finished run keeps (`saved`: its config.json), checked against the record;
  None for a run without a copy (bytes, or an older run)."""
  record = saved.get(CONFIG_KEY)
  if not isinstance(record, dict) or record.get('kind') not in FILES:
    return None
  kept = workdir_lib.resolve(workdir) / str(record.get('file', ''))
  if not kept.is_file():
    raise ConfigError(f'--workdir={workdir}: config.json records the run\'s tokenizer in {kept}, '
                      'which is missing; restore it (a copy of the tokenizer file the run '
                      'trained with), or pass the --workdir of a complete run.')
  data = kept.read_bytes()
  if hashlib.sha256(data).hexdigest() != record.get('sha256'):
    raise ConfigError(f'--workdir={workdir}: {kept} does not match the SHA-256 that config.json '
                      'records for the run\'s tokenizer; restore the file the run trained with.')
  if record['kind'] == 'char':
    return tokenizers.CharTokenizer(json.loads(data)['chars'])
  return tokenizers.load(record['kind'], _local(kept, data))


def _local(path: epath.Path, data: bytes) -> str:
  """A local file holding `data`: `path` itself, or for a remote workdir a temporary copy (the
  tokenizer libraries read local files only)."""
  if not workdir_lib.is_remote(path):
    return str(path)
  with tempfile.NamedTemporaryFile(suffix=f'-{path.name}', delete=False) as local:
    local.write(data)
  return local.name
