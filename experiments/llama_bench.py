"""The reference benchmark shapes: a small Llama-style model on synthetic tokens.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.main \
      --config=experiments/llama_bench.py:mesh=2x2x2,mode=manual --workdir=/tmp/llama_bench

Llama-style (RMSNorm, rotary positions, SwiGLU, untied head), 2 layers, width 256, 4 heads of 64,
MLP 1024, vocabulary 1024, sequence 128, global batch 8, float32, AdamW, full remat, synthetic
tokens (a seeded Markov text; only the byte ids it uses occur). These are the shapes the speed
comparisons use (python -m engine.bench); the run itself is only a smoke test.

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N, layers=2,
seq=128, batch=8, remat=full, dtype=float32, microbatches=1.
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  args = parse_run_arg(arg, steps=100, layers=2, seq=128, batch=8, remat='full',
                       dtype='float32', microbatches=1)
  config = default_config()
  config.model.name = 'llama'
  config.model.num_layers = args.layers
  config.model.embed_dim = 256
  config.model.num_heads = 4
  config.model.num_kv_heads = 4
  config.model.mlp_dim = 1024
  config.model.vocab_size = 1024
  config.model.max_len = args.seq
  config.model.tie_embeddings = False
  config.model.remat = args.remat
  config.model.dtype = args.dtype

  config.data.source = 'synthetic'
  config.data.synthetic_tokens = 400_000
  config.data.seq_len = args.seq
  config.data.global_batch_size = args.batch

  config.optim.learning_rate = 1e-3
  config.optim.warmup_steps = 10

  config.train.microbatches = args.microbatches
  config.train.log_every = 10
  config.train.eval_every = 50
  config.train.eval_batches = 4
  config.train.checkpoint_every = 1000
  return apply_run_args(config, args)
