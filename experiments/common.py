"""What several experiment files share (as big_vision's configs/common.py): each experiment
keeps only its own numbers. Experiments import it as `experiments.common` (the package is
installed with the engine)."""

from engine.config import apply_run_args, default_config, parse_run_arg


def llama3_pod(arg, *, batch: int, seq: int, layers: int, embed_dim: int, num_heads: int,
               mlp_dim: int, learning_rate: float, end_learning_rate: float):
  """A Llama-3-shaped model for planning pod runs and for pods: grouped-query attention with 8
  key/value heads, rotary base 500,000, vocabulary 128,256, untied embedding and head, bfloat16
  compute with full remat, synthetic tokens, AdamW warmed up over 2000 steps. `batch`, `seq`
  and `layers` are the defaults of the experiment arguments of the same names."""
  args = parse_run_arg(arg, steps=10_000, batch=batch, seq=seq, layers=layers, microbatches=1)
  config = default_config()
  config.model.name = 'llama'
  config.model.num_layers = args.layers
  config.model.embed_dim = embed_dim
  config.model.num_heads = num_heads
  config.model.num_kv_heads = 8
  config.model.mlp_dim = mlp_dim
  config.model.vocab_size = 128_256
  config.model.rope_base = 500_000.0
  config.model.max_len = args.seq
  config.model.tie_embeddings = False
  config.model.dtype = 'bfloat16'
  config.model.remat = 'full'

  config.data.source = 'synthetic'
  config.data.seq_len = args.seq
  config.data.global_batch_size = args.batch

  config.optim.learning_rate = learning_rate
  config.optim.end_learning_rate = end_learning_rate
  config.optim.warmup_steps = 2000
  config.optim.decay_steps = args.steps
  config.optim.weight_decay = 0.1

  config.train.microbatches = args.microbatches
  config.train.log_every = 10
  config.train.eval_every = 1000
  config.train.eval_batches = 10
  config.train.checkpoint_every = 1000
  return apply_run_args(config, args)
