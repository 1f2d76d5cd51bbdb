"""Conversations as training data (engine/data/chat.py): rendered and tokenized as transformers'
apply_chat_template does (compared with transformers itself, in the reference environment:
tests/support/reference_envs.py), the answers trained and everything else flagged as context, written as a
shard set by engine.data.prepare, and each way they can be wrong one line."""

import json
import os
import subprocess

import numpy as np
import pytest
import tokenizers

from engine.data import chat
from engine.data import shards
from engine.data import tokenizers as tokenizer_lib
from engine.data.pipeline import load_shards
from engine.data.shard_writer import prepare
from engine.errors import ConfigError
from engine.models.documents import CONTEXT_FLAG, INSIDE_FLAG, token_ids
from tests.support import chat_tokenizers
from tests.support.chat_tokenizers import CONVERSATIONS, WITH_SYSTEM
from tests.support.helpers import reference_python, tiny_config

# What each template writes after an answer, trained with it.
END_OF_ANSWER = {'chatml': '<|im_end|>\n', 'chatml_marked': '<|im_end|>\n', 'inst': '</s>'}


@pytest.fixture(scope='module')
def tokenizer_paths(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('chat_tokenizers'))
  return {name: chat_tokenizers.write(root, name) for name in chat_tokenizers.TEMPLATES}


def _encoder(path):
  template = chat.ChatTemplate(chat.find_template(path))
  raw = tokenizers.Tokenizer.from_file(path)
  return template, raw, tokenizer_lib.load('hf', path).eos_id


def _conversations(name):
  return CONVERSATIONS + ([WITH_SYSTEM] if name != 'inst' else [])


def test_the_answers_are_trained_and_the_rest_is_context(tokenizer_paths):
  for name, path in tokenizer_paths.items():
    template, raw, eos_id = _encoder(path)
    for messages in _conversations(name):
      flagged = chat.encode(template, raw, messages, eos_id)
      ids = token_ids(flagged)
      assert raw.decode(ids[:-1].tolist(), skip_special_tokens=False) == template.render(messages)
      assert ids[-1] == eos_id and flagged[-1] & CONTEXT_FLAG  # The separator: context.
      trained = ids[(flagged & CONTEXT_FLAG) == 0]
      answers = [m['content'] + END_OF_ANSWER[name] for m in messages if m['role'] == 'assistant']
      assert raw.decode(trained.tolist(), skip_special_tokens=False) == ''.join(answers), name
      # An end-of-text id inside the conversation (the inst template's end of each answer) is
      # flagged as not ending it; ChatML's end of turn is another token.
      inside = (flagged & INSIDE_FLAG) != 0
      assert inside.sum() == (len(answers) if name == 'inst' else 0), name
      assert (ids[inside] == eos_id).all() and (ids[:-1][~inside[:-1]] != eos_id).all()


def test_ids_and_answers_equal_transformers(tokenizer_paths):
  """transformers in the reference environment: its apply_chat_template's ids for
  every template and conversation, and its assistant mask for the template that marks answers
  with {% generation %}."""
  python = reference_python()
  names = {n: os.path.dirname(p) for n, p in tokenizer_paths.items() if n != 'inst'}
  request = {'tokenizers': names, 'conversations': _conversations('chatml')}
  inst = {'tokenizers': {'inst': os.path.dirname(tokenizer_paths['inst'])},
          'conversations': _conversations('inst')}
  found = {}
  for each in (request, inst):
    proc = subprocess.run([python, '-m', 'tests.support.chat_reference'], input=json.dumps(each),
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found.update(json.loads(proc.stdout))
  for name, path in tokenizer_paths.items():
    template, raw, eos_id = _encoder(path)
    for messages, reference in zip(_conversations(name), found[name]):
      flagged = chat.encode(template, raw, messages, eos_id)
      assert token_ids(flagged)[:-1].tolist() == reference['ids'], name
      if reference['mask'] is not None:
        assert ((flagged[:-1] & CONTEXT_FLAG) == 0).astype(int).tolist() == reference['mask']


@pytest.fixture
def chat_jsonl(tmp_path):
  path = tmp_path / 'chats.jsonl'
  with open(path, 'w') as f:
    for i in range(6):
      f.write(json.dumps({'id': i, 'messages': CONVERSATIONS[i % 2]}) + '\n')
  return path


def test_a_set_of_conversations_holds_their_flagged_ids(tokenizer_paths, chat_jsonl, tmp_path):
  path = tokenizer_paths['inst']
  meta = prepare([str(chat_jsonl)], 'hf', path, str(tmp_path / 'set'), processes=2,
                 record_tokens=32, messages_field='messages')
  template, raw, eos_id = _encoder(path)
  expected = np.concatenate([chat.encode(template, raw, CONVERSATIONS[i % 2], eos_id)
                             for i in range(6)])
  stream = shards.TokenStream(str(tmp_path / 'set'))
  np.testing.assert_array_equal(stream.tokens(0, stream.num_tokens), expected)
  assert meta['dtype'] == 'uint32' and meta['num_documents'] == 6
  assert meta['chat']['template'].endswith('tokenizer_config.json')
  assert max(s['max_id'] for s in meta['shards']) == token_ids(expected).max() < 400
  # Trained with document masking only: the loss stays within each conversation.
  config = tiny_config().data
  config.source, config.shards, config.tokenizer, config.seq_len = (
      'shards', str(tmp_path / 'set'), 'hf', 16)
  with pytest.raises(ConfigError, match=r'holds conversations, whose loss trains on the answers '
                     r'only .*; pass --config.data.document_masking=true\.'):
    load_shards(config)
  config.document_masking = True
  assert load_shards(config).shard_sets


@pytest.mark.parametrize('records, kind, template, message', [
    ([{'messages': 'hello'}], 'hf', '', r'cannot be read at or after record 1: JSON parse error: '
     r'Column\(/messages\) changed from array to string'),
    ([{'messages': []}], 'hf', '', r"record 1 is not a list of messages with a role and a "
     r'content string; pass --messages_field=a field of'),
    ([{'messages': WITH_SYSTEM}], 'hf', '', r"does not render a conversation \(TemplateError: "
     r'Conversation roles must alternate user/assistant/user/assistant/...\); fix the messages'),
    ([{'messages': CONVERSATIONS[0]}], 'byte', '', r'--messages_field renders conversations '
     r'with a chat template, which --tokenizer=byte has none of'),
    ([{'messages': CONVERSATIONS[0]}], 'hf', 'missing.json', r"--chat_template='missing.json' "
     r'is not a file'),
    ([{'text': 'x'}], 'hf', '', r"has no field 'messages' \(its records have 'text'\); pass "
     r'--messages_field=the field'),
])
def test_each_bad_conversation_input_is_one_line(tokenizer_paths, tmp_path, records, kind,
                                                 template, message):
  (tmp_path / 'chats.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  with pytest.raises(ConfigError, match=message):
    prepare([str(tmp_path / 'chats.jsonl')], kind, tokenizer_paths['inst'] if kind == 'hf' else '',
            str(tmp_path / 'set'), processes=1, messages_field='messages',
            chat_template=template)
  assert not os.path.exists(tmp_path / 'set')


def test_a_tokenizer_without_a_template_and_a_template_that_rewrites_turns(tmp_path):
  (tmp_path / 'tokenizer.json').write_text('{}')
  with pytest.raises(ConfigError, match=r'has no chat_template\.jinja and no '
                     r'tokenizer_config\.json with a chat_template; pass --chat_template='):
    chat.find_template(str(tmp_path / 'tokenizer.json'))
  # A template that drops earlier answers (as reasoning templates drop earlier thinking).
  (tmp_path / 'rewrite.jinja').write_text(
      "{% for m in messages %}{% if m.role == 'user' or loop.last %}{{ m.content }}|"
      "{% endif %}{% endfor %}")
  template = chat.ChatTemplate(str(tmp_path / 'rewrite.jinja'))
  with pytest.raises(ConfigError, match=r'does not render this conversation as the continuation '
                     r'of the messages before message 2 .* the answer of message 2 cannot be told apart'):
    template.answer_spans(CONVERSATIONS[0])


def test_a_template_file_of_its_own_renders_with_the_tokenizers_special_tokens(
    tokenizer_paths, tmp_path):
  (tmp_path / 'inst.jinja').write_text(chat_tokenizers.INST)
  template = chat.ChatTemplate(str(tmp_path / 'inst.jinja'), tokenizer_paths['inst'])
  assert template.render(CONVERSATIONS[1]) == (
      '<s>[INST] Count to three. [/INST]One, two, three.</s>')
