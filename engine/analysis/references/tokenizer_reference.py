"""transformers' AutoTokenizer, as the reference for `python -m engine.analysis.tokenizer_check`.

tokenizer_check starts this script as a child process with a Python that has transformers (no
torch needed), so that the engine's process never imports transformers:

  PYTHON engine/analysis/references/tokenizer_reference.py REQUEST.json

It imports neither jax nor anything from `engine`. REQUEST.json is {"text_file": PATH, "dirs":
[DIR, ...]}; for each DIR (an export's config.json and tokenizer files) it loads
AutoTokenizer.from_pretrained(DIR), encodes the whole text, and writes DIR/transformers_ids.json:
{"class": the tokenizer's class, "ids": the ids without special tokens, "ids_with_specials":
what `tokenizer(text)` gives by default, "unk_id": its unknown token's id (null if none),
"decoded": "ids" decoded without the unknown ids (which sentencepiece writes as " ⁇ ",
transformers as its unk_token), "warnings": what transformers said while loading}, or {"error":
"..."} if it could not. Then it prints one line of JSON, {"transformers": VERSION, "tokenizers":
VERSION}, and exits 0.
"""

import json
import os
import sys

import tokenizers
import transformers
from transformers import AutoTokenizer

from transformers_output import captured_warnings  # A sibling file: this runs as a script.


def tokenize(directory: str, text: str) -> dict:
  with captured_warnings() as said:
    tokenizer = AutoTokenizer.from_pretrained(directory)
  # verbose=False: no warning that the text is longer than the model's context.
  ids = tokenizer(text, add_special_tokens=False, verbose=False)['input_ids']
  unk = tokenizer.unk_token_id
  return {'class': type(tokenizer).__name__, 'ids': ids,
          'ids_with_specials': tokenizer(text, verbose=False)['input_ids'], 'unk_id': unk,
          'decoded': tokenizer.decode([i for i in ids if i != unk]), 'warnings': said}


def main(argv) -> int:
  with open(argv[1]) as f:
    request = json.load(f)
  with open(request['text_file'], encoding='utf-8') as f:
    text = f.read()
  transformers.utils.logging.disable_progress_bar()
  for directory in request['dirs']:
    try:
      reply = tokenize(directory, text)
    except Exception as error:  # pylint: disable=broad-except
      reply = {'error': f'{type(error).__name__}: {error}'}
    with open(os.path.join(directory, 'transformers_ids.json'), 'w') as f:
      json.dump(reply, f)
  print(json.dumps({'transformers': transformers.__version__,
                    'tokenizers': tokenizers.__version__}))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
