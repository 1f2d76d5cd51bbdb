"""File names that come from files: a Hugging Face index's `weight_map`, a shard set's
meta.json. A manifest names files beside it; one that points elsewhere (`../x`, an absolute
path, a link out of the directory) is refused in one line rather than read.
"""

from __future__ import annotations

import os

from engine.errors import ConfigError


def inside(directory: str, name: object, where: str) -> str:
  """The path of `name` in `directory`, once it is known to stay there."""
  if not isinstance(name, str) or not name or os.path.isabs(name):
    raise ConfigError(f'{where} names {name!r}, which is not a file name inside {directory}; '
                      'a manifest names the files beside it: rewrite it, or take it from a source '
                      'you trust.')
  root = os.path.realpath(directory)
  path = os.path.realpath(os.path.join(root, name))
  if os.path.commonpath([root, path]) != root or path == root:
    raise ConfigError(f'{where} names {name!r}, which resolves outside {directory}; a manifest '
                      'names the files beside it: rewrite it, or take it from a source you '
                      'trust.')
  return path
