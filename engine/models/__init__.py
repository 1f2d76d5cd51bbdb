"""Model registry: `model.name` -> build(model config subtree, vocab_size) -> ModelSpec.

Adding a model is one module under engine/models/ and one line here (the interface is in
engine/models/spec.py). A family that reads and writes Hugging Face checkpoints also registers
its `HFFormat` (engine/models/hf_format.py) in HF_FORMATS. Tests and experiments may also add
entries to `MODELS` at run time.
"""

from engine.models import gpt, llama, llama_hf
from engine.models.hf_format import HFFormat
from engine.models.spec import ModelSpec

MODELS = {'gpt': gpt.build, 'llama': llama.build}
HF_FORMATS = {'llama': llama_hf.FORMAT}


def build(model_config, vocab_size: int) -> ModelSpec:
  return MODELS[model_config.name](model_config, vocab_size)


def hf_format_of_architectures(architectures) -> tuple[str, HFFormat] | None:
  """(model name, format) of the family a config.json's `architectures` names, or None."""
  return next(((name, fmt) for name, fmt in HF_FORMATS.items()
               if fmt.architecture in (architectures or [])), None)
