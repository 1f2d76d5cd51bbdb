"""Character-level GPT on Tiny Shakespeare: the well-known small CPU configuration.

  python -m engine.main --config=experiments/shakespeare_char.py \
      --config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/shakespeare

Hardware: 1 CPU device (2 cores): about 3 minutes (around 11 steps/s). 4 layers, 4 heads, width
128, context 64, batch 12, 2000 steps, AdamW lr 1e-3 (100 warmup steps, cosine decay to 1e-4),
beta2 0.99, weight decay 0.1, clipping at 1.0, no dropout. Expect a validation loss of about
1.91 after 2000 steps (measured: 1.907; nanoGPT's CPU run of this configuration reports 1.88).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]] (data x fsdp x tensor
[x context [x stage [x expert]]], axes not given are 1; e.g. mesh=2x2x2 with 8 devices),
steps=2000. Example on 8 simulated CPU devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.main \
      --config=experiments/shakespeare_char.py:mesh=2x2x2 \
      --config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/shakespeare_222
"""

from engine.config import apply_run_args, default_config, parse_run_arg


def get_config(arg=None):
  config = default_config()

  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.embed_dim = 128
  config.model.mlp_dim = 512
  config.model.max_len = 64
  config.model.vocab_multiple = 8  # 65 characters -> 72 rows, splittable over tensor <= 8.
  config.model.tie_embeddings = True
  # Four small layers: written out, not scanned, the step runs 10-30 % faster on one CPU device
  # (no per-layer stacking of activations; python -m engine.bench, BUILD.md).
  config.model.scan_layers = False

  config.data.source = 'file'
  config.data.path = 'experiments/data/tinyshakespeare.txt'  # In the repository; run from its root.
  config.data.tokenizer = 'char'
  config.data.seq_len = 64
  config.data.global_batch_size = 12

  config.optim.learning_rate = 1e-3
  config.optim.end_learning_rate = 1e-4
  config.optim.warmup_steps = 100
  config.optim.b2 = 0.99
  config.optim.weight_decay = 0.1
  config.optim.grad_clip_norm = 1.0

  config.train.log_every = 100
  config.train.eval_every = 250
  config.train.eval_batches = 20
  config.train.checkpoint_every = 500
  return apply_run_args(config, parse_run_arg(arg, steps=2000))
