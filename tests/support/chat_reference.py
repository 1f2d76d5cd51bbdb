"""Run by the reference environment's Python (transformers; tests/support/reference_envs.py): reads
{"tokenizers": {name: directory}, "conversations": [...]} as JSON on stdin and prints, for each
tokenizer and conversation, transformers' `apply_chat_template` ids and, for a template that
marks its answers with {% generation %}, its assistant mask (else null)."""

import json
import re
import sys

import transformers


def main():
  request = json.load(sys.stdin)
  out = {'transformers': transformers.__version__}
  for name, directory in request['tokenizers'].items():
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    marked = bool(re.search(r'\{%-?\s*generation\s*-?%\}', tokenizer.chat_template))
    rows = []
    for messages in request['conversations']:
      encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=marked)
      rows.append({'ids': list(encoded['input_ids']),
                   'mask': list(encoded['assistant_masks']) if marked else None})
    out[name] = rows
  print(json.dumps(out))


if __name__ == '__main__':
  main()
