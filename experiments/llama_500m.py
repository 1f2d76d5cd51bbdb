"""A ~500M-parameter Llama for one accelerator: bfloat16 compute, full remat, a real text file.

  python -m engine.main --config=experiments/llama_500m.py:mesh=-1x1x1 --workdir=/tmp/llama_500m

experiments/llama_124m.py at 16 layers, width 1536, 12 heads of 128 (grouped-query: 4
key/value heads), SwiGLU MLP 4096, vocabulary 32,000, sequence 2048, global batch 8 without
micro-batches, AdamW lr 3e-4 (cosine to 3e-5); bfloat16 compute with float32 parameters and
optimizer state, full remat, as there. About 0.5B parameters; the second shape of the TPU
benchmark of record (docs/benchmarks.md), beside experiments/llama_124m.py.

Tokens: bytes of experiments/data/tinyshakespeare.txt (data.tokenizer='byte'); see
experiments/llama_124m.py for subword tokens. On the 2-core CPU machine it compiles but trains
at a few tokens/s: use experiments/shakespeare_char.py there.

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N.
"""

from experiments import llama_124m


def get_config(arg=None):
  config = llama_124m.get_config(arg)
  model = config.model
  model.num_layers, model.embed_dim, model.mlp_dim = 16, 1536, 4096
  model.num_heads, model.num_kv_heads = 12, 4  # Heads of 128.
  model.vocab_size, model.max_len = 32_000, 2048
  config.data.seq_len, config.data.global_batch_size = 2048, 8
  config.optim.learning_rate, config.optim.end_learning_rate = 3e-4, 3e-5
  config.train.microbatches = 1
  return config
