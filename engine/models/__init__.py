"""Model registry: `model.name` -> build(model config subtree, vocab_size) -> ModelSpec.

Adding a model is one module under engine/models/ and one line here (the interface is in
engine/models/spec.py). Tests and experiments may also add entries to `MODELS` at run time.
"""

from engine.models import gpt, llama
from engine.models.spec import ModelSpec

MODELS = {'gpt': gpt.build, 'llama': llama.build}


def build(model_config, vocab_size: int) -> ModelSpec:
  return MODELS[model_config.name](model_config, vocab_size)
