"""A ~500M-parameter Llama for one accelerator: bfloat16 compute, full remat, a real text file.

  python -m engine.main --config=experiments/llama_500m.py:mesh=-1x1x1 --workdir=/tmp/llama_500m

16 layers, width 1536, 12 heads of 128 (grouped-query: 4 key/value heads), SwiGLU MLP 4096,
vocabulary 32,000, sequence 2048, global batch 8 without micro-batches, bfloat16 compute with
float32 parameters and optimizer state, AdamW lr 3e-4 (warmup 200, cosine to 3e-5 at 5000
steps), weight decay 0.1 on matrices. About 0.5B parameters; the second shape of the TPU
benchmark of record (docs/benchmarks.md), beside experiments/llama_124m.py.

Tokens: bytes of experiments/data/tinyshakespeare.txt (data.tokenizer='byte'); see
experiments/llama_124m.py for subword tokens. On the 2-core CPU machine it compiles but trains
at a few tokens/s: use experiments/shakespeare_char.py there.

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N.
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  config = default_config()
  config.model.name = 'llama'
  config.model.num_layers = 16
  config.model.embed_dim = 1536
  config.model.num_heads = 12
  config.model.num_kv_heads = 4
  config.model.mlp_dim = 4096
  config.model.vocab_size = 32_000
  config.model.max_len = 2048
  config.model.tie_embeddings = False
  config.model.dtype = 'bfloat16'
  config.model.remat = 'full'

  config.data.source = 'file'
  config.data.path = 'experiments/data/tinyshakespeare.txt'  # In the repository; run from its root.
  config.data.tokenizer = 'byte'
  config.data.seq_len = 2048
  config.data.global_batch_size = 8

  config.optim.learning_rate = 3e-4
  config.optim.end_learning_rate = 3e-5
  config.optim.warmup_steps = 200
  config.optim.decay_steps = 5000
  config.optim.weight_decay = 0.1

  config.train.microbatches = 1
  config.train.log_every = 10
  config.train.eval_every = 250
  config.train.eval_batches = 10
  config.train.checkpoint_every = 500
  return apply_run_args(config, parse_run_arg(arg, steps=5000))
