"""Two tiny tokenizers with chat templates, written as a model's files (tokenizer.json and
tokenizer_config.json), for the conversation sets' tests: a ChatML template (system prompt by
default, `continue` from jinja's loop controls) whose end of turn is not the end-of-text token,
and a Llama 2 / Mistral-style one that writes the beginning-of-text token and, after each
answer, the end-of-text token (an end of turn inside the conversation), and raises on roles
that do not alternate."""

import json
import os

CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
INST = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}")
# ChatML with the answers marked for transformers' assistant mask.
CHATML_MARKED = CHATML.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message.content + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}")
TEMPLATES = {
    'chatml': (CHATML, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
               {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}),
    'chatml_marked': (CHATML_MARKED, ['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
                      {'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}),
    'inst': (INST, ['<s>', '</s>'], {'bos_token': '<s>', 'eos_token': '</s>'}),
}
CONVERSATIONS = [
    [{'role': 'user', 'content': 'What is the capital of France?'},
     {'role': 'assistant', 'content': 'Paris.'},
     {'role': 'user', 'content': 'And of Italy? Ünïcode too.'},
     {'role': 'assistant', 'content': 'Rome.'}],
    [{'role': 'user', 'content': 'Count to three.'},
     {'role': 'assistant', 'content': 'One, two, three.'}],
]
# ChatML's own system prompt; the Llama 2 / Mistral-style template raises on it.
WITH_SYSTEM = [{'role': 'system', 'content': 'Answer in one word.'}] + CONVERSATIONS[1]
TEXT = ('What is the capital of France? Paris. And of Italy? Rome. Count to three. One, two, '
        'three. Answer in one word. You are a helpful assistant. ') * 20


def write(directory: str, name: str) -> str:
  """DIRECTORY/NAME/{tokenizer.json, tokenizer_config.json}; returns tokenizer.json's path."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top
  template, specials, tokens = TEMPLATES[name]
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(
      vocab_size=400, special_tokens=specials, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  out = os.path.join(directory, name)
  os.makedirs(out, exist_ok=True)
  tokenizer.save(os.path.join(out, 'tokenizer.json'))
  with open(os.path.join(out, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'chat_template': template,
               **tokens}, f, indent=1)
  return os.path.join(out, 'tokenizer.json')
