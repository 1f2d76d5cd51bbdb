"""The shard sets a run trains on, recorded in its workdir: a resume on other data is refused.

config.json records under `shard_sets` each set of `data.shards` (by the directory as given) with
its identity (engine/data/shards.py: TokenStream.identity, the digest of its shards' contents). A
set written again in place (`engine.data.prepare --overwrite`) from other text or with another
tokenizer has another identity, and the run's data position would point into other data: the
resume is refused, naming the set. Written again from the same text and tokenizer, it resumes.
Runs recorded before this check, or on text sources, have no record and are not checked.
"""

from __future__ import annotations

from etils import epath

from engine.errors import ConfigError
from engine.workdir import run_dir

CONFIG_KEY = 'shard_sets'


def record(corpus) -> dict | None:
  """config.json's record of `corpus`'s shard sets (None for text sources)."""
  if not corpus.shard_sets:
    return None
  return {stream.directory: stream.identity for stream, _ in corpus.shard_sets}


def check_resumed(corpus, workdir: epath.Path) -> None:
  """Refuses to resume on a shard set whose content differs from the one the run recorded."""
  recorded = run_dir.recorded(workdir, CONFIG_KEY) or {}
  for directory, identity in (record(corpus) or {}).items():
    if recorded.get(directory, identity) != identity:
      raise ConfigError(
          f'data.shards: {directory!r} was written again since --workdir={workdir} trained on it '
          '(its shards differ from the ones config.json records, as after engine.data.prepare '
          '--overwrite with other text or another tokenizer), and the run\'s data position would '
          'point into other data; restore the set, or train on the new one in a new --workdir with '
          f'--config.train.init_from={workdir}.')
