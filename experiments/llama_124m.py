"""A GPT-2-small-sized Llama for accelerators: bfloat16 compute, full remat, a real text file.

  python -m engine.main --config=experiments/llama_124m.py:mesh=-1x1x1 \
      --config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/llama_124m

12 layers, width 768, 12 heads of 64 (grouped-query: 4 key/value heads), SwiGLU MLP 2048,
vocabulary 50,304 (GPT-2's 50,257 rounded up to a multiple of 128), sequence 1024, global batch
64 (8 micro-batches of 8), bfloat16 compute with float32 parameters and optimizer state, AdamW
lr 6e-4 (warmup 200, cosine to 6e-5 at 5000 steps), weight decay 0.1 on matrices. 153M
parameters: 75M in the 12 blocks (GPT-2 small's body) and 77M in the untied embedding table and
output head; 0.80 GFLOP per token for training (ModelSpec.flops_per_token).

Tokens: bytes as given (data.tokenizer='byte': only ids 0-255 of the vocabulary occur, so the loss
is per byte). For subword tokens, train a byte-level BPE tokenizer on the text, tokenize the text
once into shards with it, and train on the shards (their meta.json records the tokenizer, which
the run names with data.tokenizer):

  python -m engine.data.train_tokenizer --input=experiments/data/tinyshakespeare.txt \
      --vocab_size=2048 --out=/tmp/shakespeare_bpe.json
  python -m engine.data.prepare --input=experiments/data/tinyshakespeare.txt --tokenizer=hf \
      --tokenizer_path=/tmp/shakespeare_bpe.json --out=/tmp/shakespeare_shards
  python -m engine.main --config=experiments/llama_124m.py:mesh=-1x1x1 \
      --config.data.source=shards --config.data.shards=/tmp/shakespeare_shards \
      --config.data.tokenizer=hf --workdir=/tmp/llama_124m_bpe

The vocabulary stays 50,304 rows, which holds any tokenizer of up to that many ids;
--config.model.vocab_size=-1 sizes it to the tokenizer's instead (rounded up to a multiple of
model.vocab_multiple).

Hardware: one or more accelerators (mesh=-1x1x1 is data parallel over all of them; use fsdp or
tensor axes when memory needs it). Its speed and memory on one TPU v5e chip at batch 16
without micro-batches, in both modes: docs/benchmarks.md, the benchmark of record. On the 2-core
CPU machine it compiles and trains but at a few hundred tokens/s (use
experiments/shakespeare_char.py there).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N.
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  config = default_config()
  config.model.name = 'llama'
  config.model.num_layers = 12
  config.model.embed_dim = 768
  config.model.num_heads = 12
  config.model.num_kv_heads = 4
  config.model.mlp_dim = 2048
  config.model.vocab_size = 50_304
  config.model.max_len = 1024
  config.model.tie_embeddings = False
  config.model.dtype = 'bfloat16'
  config.model.remat = 'full'

  config.data.source = 'file'
  config.data.path = 'experiments/data/tinyshakespeare.txt'  # In the repository; run from its root.
  config.data.tokenizer = 'byte'
  config.data.seq_len = 1024
  config.data.global_batch_size = 64

  config.optim.learning_rate = 6e-4
  config.optim.end_learning_rate = 6e-5
  config.optim.warmup_steps = 200
  config.optim.decay_steps = 5000
  config.optim.weight_decay = 0.1

  config.train.microbatches = 8
  config.train.log_every = 10
  config.train.eval_every = 250
  config.train.eval_batches = 10
  config.train.checkpoint_every = 500
  return apply_run_args(config, parse_run_arg(arg, steps=5000))
