"""Tokenizes text once into ArrayRecord shards (engine/data/shards.py) for `data.source=shards`.

  python -m engine.data.train_tokenizer --input=embedded --vocab_size=4096 --out=/tmp/bpe.json
  python -m engine.data.prepare --input=embedded --tokenizer=hf --tokenizer_path=/tmp/bpe.json \
      --out=/tmp/stdlib_shards
  python -m engine.main --config=experiments/tiny.py --config.data.source=shards \
      --config.data.shards=/tmp/stdlib_shards --config.data.tokenizer=hf --workdir=/tmp/tiny_bpe

Inputs (--input, repeatable): text files, files of records (JSON lines: `.jsonl`, `.ndjson`,
`.json`; Parquet: `.parquet`), a Hugging Face `datasets` directory written by `save_to_disk` (one
split's), directories of any of them (every file, recursively, in name order), or `embedded` (the
standard library's modules). A text file is one document; each record is one, its --text_field
(`text` by default). Record files are streamed a batch of records at a time, so memory stays
bounded whatever their size (a text file is read whole). A document
longer than `piece_bytes` (an argument of `prepare()`, 1 << 20 by default, counted in characters,
which are bytes for ASCII text; no flag sets it) is tokenized in pieces, each cut after the last
newline within that length, or at the length where there is none (subword merges never cross a
piece boundary). Pieces are tokenized by --processes worker processes (0, the default: one per
core), in order; each document is preceded by the tokenizer's beginning-of-text token and
followed by its end-of-text token, where it has them. --tokenizer is byte, hf or sentencepiece
(a character vocabulary is fitted to one corpus in memory, so it cannot write shards). A
progress line goes to the log, and the last line printed gives the tokens, documents, shards and
tokens/s.

The set is written into OUT.tmp-* beside --out and renamed to --out when meta.json is written
(last), so a failure leaves no set; an --out that holds a set (or part of one) is replaced only
with --overwrite, and one holding other files never. An input without text, a missing tokenizer
file, --record_tokens or --records_per_shard below 1 and --processes below 0 are refused before
anything is written, and so is a record file whose records lack --text_field (the error names
the fields they have); a record without it is refused naming its number.

Conversations (--messages_field=messages: records whose field is a list of {role, content}
messages) make a set for supervised fine-tuning: each is rendered with the tokenizer's chat
template (--chat_template, default chat_template.jinja or tokenizer_config.json beside
--tokenizer_path) exactly as transformers' apply_chat_template renders and tokenizes it, and the
tokens outside the assistant's answers are flagged so that the loss leaves them out
(engine/data/chat.py); train on it with data.document_masking=true.

  python -m engine.data.prepare --input=chats.jsonl --messages_field=messages --tokenizer=hf \
      --tokenizer_path=/models/qwen/tokenizer.json --out=/tmp/chat_shards
"""

from __future__ import annotations

from absl import flags

from engine.data.shard_writer import prepare
from engine.cli.command_line import run_command

_INPUTS = flags.DEFINE_multi_string('input', None, 'Text, JSON lines or Parquet file, datasets '
                                    'directory, directory of them, or "embedded"; repeatable.')
_KIND = flags.DEFINE_enum('tokenizer', 'hf', ['byte', 'hf', 'sentencepiece'], 'Tokenizer kind.')
_PATH = flags.DEFINE_string('tokenizer_path', '', 'tokenizer.json (hf) or .model file.')
_OUT = flags.DEFINE_string('out', None, 'Directory to write the shards and meta.json to.')
_PROCESSES = flags.DEFINE_integer('processes', 0, 'Tokenizing processes (0: one per core).')
_RECORD_TOKENS = flags.DEFINE_integer('record_tokens', 4096, 'Tokens per record.')
_RECORDS_PER_SHARD = flags.DEFINE_integer('records_per_shard', 1024, 'Records per shard file.')
_TEXT_FIELD = flags.DEFINE_string('text_field', 'text', 'The field of JSON lines, Parquet and '
                                  'datasets records that holds the text.')
_MESSAGES_FIELD = flags.DEFINE_string(
    'messages_field', '', 'The field of records that holds a conversation (a list of {role, '
    'content} messages): a set for supervised fine-tuning, the loss on the answers only.')
_CHAT_TEMPLATE = flags.DEFINE_string(
    'chat_template', '', 'With --messages_field: a tokenizer_config.json or .jinja file holding '
    'the chat template (default: the one beside --tokenizer_path).')
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace the shard set already in --out.')


def main(argv):
  del argv
  meta = prepare(_INPUTS.value, _KIND.value, _PATH.value, _OUT.value, _PROCESSES.value,
                 _RECORD_TOKENS.value, _RECORDS_PER_SHARD.value, overwrite=_OVERWRITE.value,
                 text_field=_TEXT_FIELD.value, messages_field=_MESSAGES_FIELD.value,
                 chat_template=_CHAT_TEMPLATE.value)
  print(f'{_OUT.value}: {meta["num_tokens"]} tokens from {meta["num_documents"]} documents in '
        f'{len(meta["shards"])} shards, {meta["num_tokens"] / meta["seconds"]:,.0f} tokens/s')


if __name__ == '__main__':
  run_command(main, 'engine.data.prepare', required=('input', 'out'))

