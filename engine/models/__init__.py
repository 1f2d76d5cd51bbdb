"""Model registry: `model.name` -> build(model config subtree, vocab_size) -> ModelSpec.

Adding a model is one module under engine/models/ and one line here (the interface is in
engine/models/spec.py). A family that reads and writes Hugging Face checkpoints also registers
its `HFFormat` (engine/models/hf_format.py) in HF_FORMATS. Tests and experiments may also add
entries to `MODELS` at run time.

  spec.py            ModelSpec: the interface every model plugs in through
  ops.py             the operations a model calls where a layout may communicate (LocalOps)
  layers.py          shared building blocks: 2-D dense products, stacked and scanned layers
  attention.py       causal attention: einsum, jax.nn.dot_product_attention or splash
  splash.py          the Pallas TPU splash-attention kernel, whole and per ring block
  documents.py       packed documents: segment ids and in-document positions
  gpt.py             a GPT-2-style decoder
  llama.py           a Llama-style decoder (optionally a mixture of experts)
  moe.py             the mixture-of-experts layer: router, top-k, experts, auxiliary losses
  moe_dispatch.py    its dispatches on one device: dropless (ragged_dot), capacity
  hf_format.py       HFTensor, HFFormat: how a family describes its Hugging Face checkpoints
  llama_hf.py        the Llama family's formats (Llama 2 / 3.x, Mistral, Qwen2, Qwen3)
  llama_moe_hf.py    its mixtures of experts' formats (Mixtral, Qwen3-MoE)
"""

from engine.models import gpt, llama, llama_hf, llama_moe_hf
from engine.models.hf_format import HFFormat
from engine.models.spec import ModelSpec

MODELS = {'gpt': gpt.build, 'llama': llama.build}
# Hugging Face architecture -> its format; the first of a model's is what it exports by default.
HF_FORMATS = {fmt.architecture: fmt for fmt in llama_hf.FORMATS + llama_moe_hf.FORMATS}


def build(model_config, vocab_size: int) -> ModelSpec:
  return MODELS[model_config.name](model_config, vocab_size)


def hf_format_of_architectures(architectures) -> HFFormat | None:
  """The format a config.json's `architectures` names, or None."""
  return next((HF_FORMATS[a] for a in architectures or [] if a in HF_FORMATS), None)


def hf_format_for(model_config) -> HFFormat | None:
  """The format a model exports as: the architecture it was loaded from (model.hf_architecture),
  else the first of its family's (dense, or mixture-of-experts formats as the model is) that
  writes it (`HFFormat.unwritable`), else the first of them; None for a model with no Hugging
  Face format."""
  if model_config.get('hf_architecture'):
    return HF_FORMATS.get(model_config.hf_architecture)
  moe = bool(model_config.get('num_experts', 0))
  own = [fmt for fmt in HF_FORMATS.values() if fmt.model == model_config.name and fmt.moe == moe]
  return next((fmt for fmt in own if not unwritable(fmt, model_config)), own[0] if own else None)


def unwritable(fmt: HFFormat, model_config) -> str:
  """What of the model `fmt` cannot write; '' if nothing."""
  return fmt.unwritable(model_config) if fmt.unwritable else ''
