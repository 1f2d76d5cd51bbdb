"""Model registry: `model.name` -> build(model config subtree, vocab_size) -> ModelSpec.

Adding a model is one module (or a folder, as llama/) under engine/models/ and one line here (the
interface is in engine/models/spec.py). A model with `model.*` keys of its own declares them
(ConfigKey, engine/models/config_keys.py) with the check of their values, in a module without JAX,
and registers both in MODEL_KEYS and MODEL_CHECKS: engine/config.py's schema merges the keys, and
engine.validation calls the check. A family that reads and writes Hugging Face checkpoints also
registers its `HFFormat` (engine/models/formats/interface.py) in HF_FORMATS. Tests and experiments
may also add entries to `MODELS` at run time.

MODELS and HF_FORMATS import the models, and with them JAX, on first use (`__getattr__`): the
config schema reads MODEL_KEYS where JAX is never imported (the launchers).

  spec.py            ModelSpec: the interface every model plugs in through
  config_keys.py     ConfigKey, ModelConfigError: a model's own config keys and their checks
  ops.py             the operations a model calls where a layout may communicate (LocalOps)
  layers.py          shared building blocks: 2-D dense products, stacked and scanned layers
  dense_taps.py      a stack's backward pass in an input-gradient and a weight-gradient half
  quantized_matmul.py  int8 / fp8 projections, forward and backward (Qwix's quantized training)
  varying_axes.py    shard_map's varying-axes types, and the casts that widen them
  documents.py       packed documents: segment ids and in-document positions
  chunked_loss.py    the next-token loss over slices of the positions (model.loss_chunks)
  cross_entropy.py   the next-token cross-entropy and its own backward pass (no float32 logits)
  gpt.py             a GPT-2-style decoder

  attention/         causal attention: its spec, the einsum / dot_product_attention / splash paths
  llama/             the Llama family: the model whose options make Mistral, Qwen, Gemma and
                     DeepSeek; its keys, its registry entry, latent attention, LoRA
  moe/               the mixture-of-experts layer, its dispatches, keys and balancing
  formats/           each family's Hugging Face checkpoints: tensor tables and config keys
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.models.llama import config as llama_config
from engine.models.config_keys import ConfigKey

if TYPE_CHECKING:
  from engine.models.formats.interface import HFFormat
  from engine.models.spec import ModelSpec

# model.name -> the `model.*` keys only that model reads (beyond engine/config.py's shared ones),
# and the check of its model config against the mesh's sizes (raising ModelConfigError).
MODEL_KEYS = {'gpt': (), 'llama': llama_config.CONFIG_KEYS}
MODEL_CHECKS = {'llama': llama_config.check}


def _registries() -> dict[str, object]:
  # pylint: disable-next=g-import-not-at-top
  from engine.models import gpt, spec
  from engine.models.formats import deepseek as deepseek_hf
  from engine.models.formats import gemma as gemma_hf
  from engine.models.formats import interface as hf_format
  from engine.models.formats import llama as llama_hf
  from engine.models.formats import llama_moe as llama_moe_hf
  from engine.models.llama import spec as llama_spec
  return {
      'MODELS': {'gpt': gpt.build, 'llama': llama_spec.build},
      # Hugging Face architecture -> its format; the first of a model's is what it exports by
      # default.
      'HF_FORMATS': {fmt.architecture: fmt for fmt in (llama_hf.FORMATS + gemma_hf.FORMATS +
                                                        llama_moe_hf.FORMATS +
                                                        deepseek_hf.FORMATS)},
      'HFFormat': hf_format.HFFormat, 'ModelSpec': spec.ModelSpec}


def __getattr__(name: str):
  """MODELS, HF_FORMATS (and the classes HFFormat, ModelSpec), made on first use and kept."""
  if name not in ('MODELS', 'HF_FORMATS', 'HFFormat', 'ModelSpec'):
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  for key, value in _registries().items():
    globals().setdefault(key, value)
  return globals()[name]


def schema_keys() -> list[ConfigKey]:
  """Every model's own keys, each once, in MODEL_KEYS' order: what engine/config.py merges into
  the schema's model section."""
  keys = {}
  for model_keys in MODEL_KEYS.values():
    for key in model_keys:
      if keys.setdefault(key.name, key).default != key.default:
        raise ValueError(f'model.{key.name} is declared by two models with different defaults.')
  return list(keys.values())


def owners(name: str) -> list[str]:
  """The models that declare the key `model.<name>` (MODEL_KEYS)."""
  return [model for model, keys in MODEL_KEYS.items() if any(k.name == name for k in keys)]


def build(model_config, vocab_size: int) -> ModelSpec:
  return __getattr__('MODELS')[model_config.name](model_config, vocab_size)


def hf_format_of_architectures(architectures) -> HFFormat | None:
  """The format a config.json's `architectures` names, or None."""
  formats = __getattr__('HF_FORMATS')
  return next((formats[a] for a in architectures or [] if a in formats), None)


def hf_format_for(model_config) -> HFFormat | None:
  """The format a model exports as: the architecture it was loaded from (model.hf_architecture),
  else the first of its family's formats of its kind (dense or mixture of experts, with or
  without latent attention) that writes it (`HFFormat.unwritable`), else the first of them; None
  for a model with no Hugging Face format."""
  formats = __getattr__('HF_FORMATS')
  if model_config.get('hf_architecture'):
    return formats.get(model_config.hf_architecture)
  moe = bool(model_config.get('num_experts', 0))
  latent = bool(model_config.get('mla_kv_rank', 0))
  own = [fmt for fmt in formats.values()
         if fmt.model == model_config.name and (fmt.moe, fmt.latent) == (moe, latent)]
  return next((fmt for fmt in own if not unwritable(fmt, model_config)), own[0] if own else None)


def unwritable(fmt: HFFormat, model_config) -> str:
  """What of the model `fmt` cannot write; '' if nothing."""
  return fmt.unwritable(model_config) if fmt.unwritable else ''
