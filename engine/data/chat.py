"""Conversations (lists of {role, content} messages) rendered with a tokenizer's chat template as
transformers' `apply_chat_template` renders them (the same sandboxed Jinja environment, filters
and variables), tokenized as it tokenizes them (no special tokens added), with the assistant's
answers marked: the ids of a shard set of conversations (`engine.data.prepare --messages_field`).

Each answer's span is what rendering the conversation up to that message adds to rendering the
messages before it with the generation prompt (so the prompt's own tokens, like `<|im_start|>
assistant\\n`, are context, and the answer's end of turn is trained); a token is trained when it
overlaps an answer's span, the rule transformers applies to a template's `{% generation %}`
blocks. Every other token is flagged as context, an end-of-text id inside the conversation as
not ending it, and the conversation is followed by the end-of-text id flagged as context
(engine/models/documents.py): packed with document masking, the loss trains on the answers
only.
"""

from __future__ import annotations

import datetime
import json
import os

import numpy as np

from engine.errors import ConfigError
from engine.models import documents

# transformers' named special tokens, passed to every template as variables.
SPECIAL_TOKENS = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token',
                  'mask_token')


def _token_text(value) -> str | None:
  """A tokenizer_config.json special token: a string, or an AddedToken's dict."""
  if isinstance(value, dict):
    return value.get('content')
  return value if isinstance(value, str) else None


def _environment():
  """transformers' chat template environment (utils/chat_template_utils.py)."""
  import jinja2  # pylint: disable=g-import-not-at-top
  import jinja2.ext  # pylint: disable=g-import-not-at-top
  from jinja2 import nodes, sandbox  # pylint: disable=g-import-not-at-top

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the answers for
    transformers' assistant mask) renders its body; the answers' spans are found by rendering
    (ChatTemplate.answer_spans) whether a template marks them or not."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(['name:endgeneration'], drop_needle=True)
      return nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  environment = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
  environment.filters['tojson'] = tojson
  environment.globals['raise_exception'] = raise_exception
  environment.globals['strftime_now'] = lambda f: datetime.datetime.now().strftime(f)
  return environment


def find_template(tokenizer_path: str, chat_template: str = '') -> str:
  """The file holding the chat template: `chat_template` when given, else beside the tokenizer
  file, chat_template.jinja or tokenizer_config.json (which must hold one)."""
  if chat_template:
    if not os.path.isfile(chat_template):
      raise ConfigError(f'--chat_template={chat_template!r} is not a file; pass a '
                        'tokenizer_config.json with a chat_template, or a .jinja file.')
    return chat_template
  directory = os.path.dirname(os.path.abspath(tokenizer_path))
  for name in ('chat_template.jinja', 'tokenizer_config.json'):
    path = os.path.join(directory, name)
    if os.path.isfile(path) and (name.endswith('.jinja') or 'chat_template' in _read_json(path)):
      return path
  raise ConfigError(f'--messages_field renders conversations with a chat template, but '
                    f'{directory!r} (beside --tokenizer_path) has no chat_template.jinja and no '
                    'tokenizer_config.json with a chat_template; pass --chat_template=a file '
                    "holding one (the model's tokenizer_config.json).")


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f'{path!r} is not a JSON file ({e}); pass the model\'s '
                      'tokenizer_config.json.') from None


class ChatTemplate:
  """A chat template and the special tokens it is rendered with."""

  def __init__(self, path: str, tokenizer_path: str = ''):
    """`path`: a tokenizer_config.json or a .jinja file; the special tokens come from the
    tokenizer's files (beside `tokenizer_path`, else beside `path`), then from `path` itself."""
    import jinja2  # pylint: disable=g-import-not-at-top
    self.path = path
    directory = os.path.dirname(os.path.abspath(tokenizer_path or path))
    config = {}
    for name in ('special_tokens_map.json', 'tokenizer_config.json'):  # The latter wins.
      if os.path.isfile(os.path.join(directory, name)):
        config.update(_read_json(os.path.join(directory, name)))
    if path.endswith('.json'):
      config.update(_read_json(path))
      source = config.get('chat_template')
      if isinstance(source, list):  # Named templates: the default one.
        source = next((t['template'] for t in source if t.get('name') == 'default'), None)
      if not isinstance(source, str):
        raise ConfigError(f'{path!r} holds no chat_template string; pass a tokenizer_config.json '
                          'with one, or a .jinja file.')
    else:
      with open(path, encoding='utf-8') as f:
        source = f.read()
    self.variables = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS
                      if _token_text(config.get(name)) is not None}
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateError as e:
      raise ConfigError(f'the chat template in {path!r} does not compile ({e}); pass a file with '
                        'a valid one (--chat_template).') from None

  def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
    import jinja2  # pylint: disable=g-import-not-at-top
    try:
      return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   tools=None, documents=None, **self.variables)
    except jinja2.TemplateError as e:
      raise ConfigError(f'the chat template in {self.path!r} does not render a conversation '
                        f'({type(e).__name__}: {e}); fix the messages, or pass another '
                        'template (--chat_template).') from None

  def answer_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span of each assistant message)."""
    text = self.render(messages)
    spans = []
    for i, message in enumerate(messages):
      if message.get('role') != 'assistant':
        continue
      prompt = self.render(messages[:i], add_generation_prompt=True)
      through = self.render(messages[:i + 1])
      if not (text.startswith(through) and through.startswith(prompt)):
        raise ConfigError(
            f'the chat template in {self.path!r} does not render this conversation as the '
            f'continuation of the messages before message {i + 1} (it rewrites earlier turns), so '
            f'the answer of message {i + 1} cannot be told apart; pass a template that renders '
            'turns in order (--chat_template).')
      spans.append((len(prompt), len(through)))
    return text, spans


def messages_of(record, what: str) -> list[dict]:
  """A record's messages, keys without a value left out (as if absent from the JSON)."""
  if not isinstance(record, list) or not all(
      isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)
      for m in record) or not record:
    raise ConfigError(f'{what} is not a list of messages with a role and a content string; '
                      'pass --messages_field=a field of [{"role": ..., "content": ...}, ...].')
  return [{k: v for k, v in m.items() if v is not None} for m in record]


def encode(template: ChatTemplate, tokenizer, messages: list[dict], eos_id: int) -> np.ndarray:
  """The conversation's flagged ids (int64), its end-of-text separator last. `tokenizer`: a
  `tokenizers.Tokenizer`."""
  text, spans = template.answer_spans(messages)
  encoding = tokenizer.encode(text, add_special_tokens=False)
  ids = np.asarray(encoding.ids, np.int64)
  trained = np.zeros(len(ids), bool)
  for start, end in spans:
    trained |= np.array([s < end and e > start for s, e in encoding.offsets], bool)
  flagged = (ids | np.where(trained, 0, documents.CONTEXT_FLAG) |
             np.where(ids == eos_id, documents.INSIDE_FLAG, 0))
  return np.append(flagged, eos_id | documents.CONTEXT_FLAG)
