"""A Llama-3-8B-shaped model for planning pod runs (python -m engine.plan) and for pods.

  python -m engine.plan --config=experiments/llama_8b.py --topology=v5p:4x4x8 \
      --meshes=8x16x1,1x32x4,1x16x1x1x8 --out=/tmp/plan_8b

32 layers, width 4096, 32 heads of 128 (grouped-query: 8 key/value heads), SwiGLU MLP 14336,
rotary base 500,000, vocabulary 128,256, untied embedding and head: 8.03B parameters, 6.98B of
them in the blocks. Sequence 8192, global batch 128 (1M tokens per step), bfloat16 compute with
float32 parameters and AdamW state, full remat. Synthetic tokens: the shapes are the point (a
real run brings its own data, --config.data.source=file).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N,
batch=128, seq=8192, layers=32, microbatches=1.
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  args = parse_run_arg(arg, steps=10_000, batch=128, seq=8192, layers=32, microbatches=1)
  config = default_config()
  config.model.name = 'llama'
  config.model.num_layers = args.layers
  config.model.embed_dim = 4096
  config.model.num_heads = 32
  config.model.num_kv_heads = 8
  config.model.mlp_dim = 14336
  config.model.vocab_size = 128_256
  config.model.rope_base = 500_000.0
  config.model.max_len = args.seq
  config.model.tie_embeddings = False
  config.model.dtype = 'bfloat16'
  config.model.remat = 'full'

  config.data.source = 'synthetic'
  config.data.seq_len = args.seq
  config.data.global_batch_size = args.batch

  config.optim.learning_rate = 3e-4
  config.optim.end_learning_rate = 3e-5
  config.optim.warmup_steps = 2000
  config.optim.decay_steps = args.steps
  config.optim.weight_decay = 0.1

  config.train.microbatches = args.microbatches
  config.train.log_every = 10
  config.train.eval_every = 1000
  config.train.eval_batches = 10
  config.train.checkpoint_every = 1000
  return apply_run_args(config, args)
