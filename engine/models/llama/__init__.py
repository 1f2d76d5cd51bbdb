"""The Llama family: one decoder whose options compute every Llama-derived checkpoint the engine
reads. Its Hugging Face tables are engine/models/formats/; which options each family sets:

  Llama 2 / 3.x   the plain model (rotary `default`, `linear` or `llama3` frequencies)
  Mistral         model.sliding_window
  Qwen2 / 2.5     model.qkv_bias (and a sliding window from max_window_layers on)
  Qwen3           model.qk_norm (a norm over each query / key head)
  Gemma 2 / 3     model.post_norms, mlp_activation=gelu_tanh, embed_scale, attention_softcap,
                  logit_softcap, attention_scale, global_every, rope_local_base, sliding_window
  Mixtral, Qwen3-MoE  model.num_experts > 0 (engine/models/moe/)
  DeepSeek-V3     model.mla_kv_rank > 0 (latent attention), experts with sigmoid group routing,
                  model.dense_layers

  model.py            Llama, Block, LlamaConfig: the decoder and its options
  config.py           the `model.*` keys only this family reads, and their checks (no JAX: the
                      config schema imports it)
  spec.py             the registry entry: those keys read into a LlamaConfig, the model's sizes
  layers.py           RMSNorm and rotary positions, shared by both attentions
  latent_attention.py multi-head latent attention (DeepSeek-V2 / V3)
  lora.py             low-rank adapters on the projections; the model's spec marks only them
                      trainable

This package's own import stays free of JAX (engine/config.py reads config.py without it).
"""
