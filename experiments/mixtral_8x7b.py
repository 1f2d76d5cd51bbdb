"""A Mixtral-8x7B-shaped mixture of experts for planning pod runs (python -m engine.plan).

  python -m engine.plan --config=experiments/mixtral_8x7b.py --topology=v5p:4x4x8 \
      --meshes=1x16x1x1x1x8,4x4x1x1x1x8,1x128x1 --modes=auto,manual --out=/tmp/plan_mixtral

32 layers, width 4096, 32 heads of 128 (grouped-query: 8 key/value heads), every MLP 8 SwiGLU
experts of 14336 with 2 routed per token (softmax then top-2, dropless), rotary base 1,000,000,
vocabulary 32,000, untied embedding and head: 46.7B parameters, 12.9B of them active per token.
Sequence 4096, global batch 256 (1M tokens per step), bfloat16 compute with float32 parameters
and AdamW state, full remat. Synthetic tokens: the shapes are the point.

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N,
batch=256, seq=4096, layers=32, microbatches=1.
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  args = parse_run_arg(arg, steps=10_000, batch=256, seq=4096, layers=32, microbatches=1)
  config = default_config()
  config.model.name = 'llama'
  config.model.num_layers = args.layers
  config.model.embed_dim = 4096
  config.model.num_heads = 32
  config.model.num_kv_heads = 8
  config.model.head_dim = 128
  config.model.mlp_dim = 14336
  config.model.num_experts = 8
  config.model.experts_per_token = 2
  config.model.moe_mlp_dim = 14336
  config.model.moe_dispatch = 'dropless'
  config.model.vocab_size = 32_000
  config.model.rope_base = 1_000_000.0
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
