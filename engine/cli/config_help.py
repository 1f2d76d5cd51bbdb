"""Finding one's way in the config: a suggestion for a key the config does not have, and
`--print_config`'s listing of every key with its value and one line of help.

The help is the comment on each key in engine/config.py's default_config(), read from the
source at run time, so the schema and its documentation stay one text; a key a model declares
itself (engine/models/__init__.py: MODEL_KEYS) brings its help with it.
"""

import difflib
import functools
import tokenize

from ml_collections import ConfigDict

from engine import config as config_lib
from engine import models
from engine.errors import ConfigError

# Words a key's name may carry that a user leaves out: 'steps' means num_steps, not warmup_steps.
_IMPLIED_WORDS = ('num', 'global')


def _leaves(defaults: dict[str, object]) -> list[str]:
  """The keys that hold values, in default_config()'s order (a ConfigDict sorts its keys)."""
  order = {key: i for i, key in enumerate(key_help())}
  return sorted((key for key, value in defaults.items() if not isinstance(value, ConfigDict)),
                key=lambda key: order.get(key, len(order)))


def _ends(text: str, words: list[str], i: int) -> set[int]:
  """The word indices j such that `text` abbreviates words[i:j]: a prefix of each word in turn
  ('lr': learning_rate, 'emb_dim': embed_dim); an underscore in `text` starts the next word."""
  if not text:
    return {i}
  if i == len(words):
    return set()
  ends = set()
  for n in range(1, min(len(text), len(words[i])) + 1):
    if text[n - 1] != words[i][n - 1]:
      break
    ends |= _ends(text[n:].removeprefix('_'), words, i + 1)
  return ends


def _abbreviation_score(name: str, key_name: str) -> tuple[int, int, int] | None:
  """How well `name` abbreviates `key_name` (lower is better), or None: first whether the words
  abbreviated end at the last one (the noun), then the words left out (other than
  _IMPLIED_WORDS), then the implied ones left out."""
  if len(name) < 2 or name == key_name:
    return None
  words, best = key_name.split('_'), None
  for start in range(len(words)):
    for end in _ends(name, words, start):
      left_out = words[:start] + words[end:]
      implied = sum(word in _IMPLIED_WORDS for word in left_out)
      score = (int(end != len(words)), len(left_out) - implied, implied)
      best = score if best is None or score < best else best
  return best


def _best_abbreviated(name: str, keys: list[str]) -> list[str]:
  scores = {key: _abbreviation_score(name, key.rpartition('.')[2]) for key in keys}
  scores = {key: score for key, score in scores.items() if score is not None}
  return [key for key, score in scores.items() if score == min(scores.values())]


def suggest(key: str, defaults: dict[str, object] | None = None) -> list[str]:
  """The keys a user who typed `key` (not in the config) most likely meant, best first (none,
  one, or a few equally likely): in the key's own section an abbreviation ('optim.lr'), the same
  name in another section ('train.learning_rate'), a misspelling; then anywhere in the config
  an abbreviation ('bs': data.global_batch_size) or a misspelling. Nothing when nothing is
  close ('mesh.foo')."""
  defaults = config_lib.flat_defaults() if defaults is None else defaults
  leaves = _leaves(defaults)
  section, _, name = key.rpartition('.')
  own = [k for k in leaves if k.rpartition('.')[0] == section] if section in defaults else []
  others = [k for k in leaves if k not in own]
  tiers = (
      lambda: _best_abbreviated(name, own),
      lambda: [k for k in others if k.rpartition('.')[2] == name],
      lambda: [f'{section}.{c}' for c in difflib.get_close_matches(
          name, [k.rpartition('.')[2] for k in own], n=1)],
      lambda: _best_abbreviated(name, leaves),
      # A misspelt section ('optm.b2'); a real section's own keys were tried above.
      lambda: [] if own else difflib.get_close_matches(key, leaves, n=1),
      lambda: [k for k in leaves if k.rpartition('.')[2] in
               difflib.get_close_matches(name, [k.rpartition('.')[2] for k in leaves], n=1)])
  for tier in tiers:
    found = tier()
    if found:
      return found[:3]
  return []


def did_you_mean(key: str, defaults: dict[str, object] | None = None) -> str:
  """' (did you mean a.b?)', ' (did you mean a.b or c.d?)', or '' when nothing is close."""
  found = suggest(key, defaults)
  if not found:
    return ''
  listed = found[0] if len(found) == 1 else f'{", ".join(found[:-1])} or {found[-1]}'
  return f' (did you mean {listed}?)'


def _unknown_keys(config: ConfigDict, schema: ConfigDict, prefix: str = '') -> list[str]:
  unknown = []
  for key, value in config.items():
    if key not in schema:
      unknown.append(prefix + key)
    elif isinstance(value, ConfigDict) and isinstance(schema[key], ConfigDict):
      unknown += _unknown_keys(value, schema[key], prefix + key + '.')
  return unknown


def check_known_keys(config: ConfigDict) -> None:
  """Raises if `config` (an experiment's) sets keys the schema does not have."""
  unknown = _unknown_keys(config, config_lib.default_config())
  if unknown:
    hint = did_you_mean(unknown[0]) if len(unknown) == 1 else ''
    raise ConfigError(f'Unknown config keys {unknown}{hint}; see engine/config.py '
                      'default_config() for the schema (a typo in an override?).')


@functools.cache
def key_help() -> dict[str, str]:
  """Each key of default_config() ('optim.learning_rate') -> its comment in engine/config.py,
  on one line: the comment lines just above the assignment, then the one after it; the models'
  own keys (models.schema_keys) -> their ConfigKey.help, where default_config() merges them."""
  helps, above, tokens, comment_row = {}, [], [], 0
  with open(config_lib.__file__, 'rb') as source:
    for token in tokenize.tokenize(source.readline):
      if token.type == tokenize.COMMENT:
        if tokens:
          tokens.append(token)
        else:
          above.append(token.string.lstrip('#').strip())
          comment_row = token.start[0]
      elif token.type == tokenize.NEWLINE:
        if 'schema_keys' in (t.string for t in tokens):  # The loop that merges the models' keys.
          helps.update((f'model.{key.name}', key.help) for key in models.schema_keys())
        _add_help(helps, tokens, above)
        above, tokens = [], []
      elif token.type == tokenize.NL:
        if not tokens and token.start[0] != comment_row:
          above = []  # A blank line: the comment above it is not this key's.
      elif token.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
        tokens.append(token)
  return helps


def _add_help(helps: dict[str, str], tokens: list[tokenize.TokenInfo], above: list[str]) -> None:
  """Records the help of one logical line if it is `c.key = value` or `c.section.key = value`."""
  text = [t.string for t in tokens]
  if '=' not in text or text[0] != 'c':
    return
  target = text[:text.index('=')]
  if len(target) not in (3, 5) or target[1::2] != ['.'] * (len(target) // 2):
    return
  key = '.'.join(target[2::2])
  after = [t.string.lstrip('#').strip() for t in tokens if t.type == tokenize.COMMENT]
  helps[key] = ' '.join(above + after)


def format_config(config: ConfigDict) -> str:
  """Every key of the schema with its value in `config` and its help, one line each, a blank
  line between sections, in default_config()'s order."""
  lines, section, helps = [], None, key_help()
  for key in _leaves(config_lib.flat_defaults()):
    value = config
    for part in key.split('.'):
      value = value[part]
    if key.rpartition('.')[0] != section and lines:
      lines.append('')
    section = key.rpartition('.')[0]
    lines.append(f'{key} = {value!r}  # {helps.get(key, "")}'.rstrip(' #'))
  return '\n'.join(lines)
