"""Model registry: name -> factory(model config subtree, vocab_size) -> (Rngs -> nnx.Module)."""

from engine.models.gpt import GPT, GPTConfig


def _gpt(model_config, vocab_size: int):
  cfg = GPTConfig(
      vocab_size=vocab_size, num_layers=model_config.num_layers,
      num_heads=model_config.num_heads, embed_dim=model_config.embed_dim,
      mlp_dim=model_config.mlp_dim, max_len=model_config.max_len,
      tie_embeddings=model_config.tie_embeddings, scan_layers=model_config.scan_layers,
      init_std=model_config.init_std)
  return lambda rngs: GPT(cfg, rngs)


MODELS = {'gpt': _gpt}
