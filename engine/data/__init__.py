"""Everything between text on disk and a global token batch on the mesh.

  sources.py          text sources: a file or directory, the embedded corpus, synthetic text
  record_files.py     documents kept as records (JSON lines, Parquet, a datasets directory),
                      streamed with pyarrow
  tokenizers.py       byte, char, Hugging Face and SentencePiece tokenizers
  chat.py             conversations rendered with a chat template as transformers does, the
                      answers marked for the loss
  prompts.py          a prompt's ids: the beginning-of-text id, then the text's
  shards.py           the pre-tokenized shard format (ArrayRecord + meta.json), its reader
  shard_meta.py       a shard set's meta.json checked against itself, its files and the run
  pipeline.py         the corpus, grain pipelines, per-process rows -> global jax.Arrays
  shard_writer.py     text -> a shard set, tokenized in parallel, written whole or not at all
  prepare.py          shard_writer's command, `python -m engine.data.prepare`
  bpe_trainer.py      a byte-level BPE tokenizer trained on documents, its tokenizer.json
  train_tokenizer.py  bpe_trainer's command, `python -m engine.data.train_tokenizer`
  manifest_paths.py   file names read from manifests (an HF index, meta.json) kept inside
                      their directory
  text_files.py       text files a user names (data.path, --text_file, --prompts_file), checked
                      and read

The names below are the package's interface; the rest of the engine imports them from here.
"""

from engine.data.pipeline import (Corpus, RecordedTokenizer, batches, describe, eval_batches,
                                  load_corpus, load_shards, train_iterator, to_global,
                                  windows_dataset)
from engine.data.sources import (documents, embedded_corpus, load_text, read_text_file,
                                 synthetic_corpus)

__all__ = ['Corpus', 'RecordedTokenizer', 'batches', 'describe', 'documents', 'embedded_corpus',
           'eval_batches', 'load_corpus', 'load_shards', 'load_text', 'read_text_file',
           'synthetic_corpus', 'to_global', 'train_iterator', 'windows_dataset']
