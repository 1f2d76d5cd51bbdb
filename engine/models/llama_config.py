"""The keys only the Llama family reads (engine/models/llama.py; its mixture of experts':
engine/models/moe_config.py) and their checks, declared apart from the model so that
engine.config reads them without JAX."""

from __future__ import annotations

from engine.models import moe_config
from engine.models.config_keys import (ConfigKey, ModelConfigError, choose, require_finite,
                                       require_positive)

ROPE_TYPES = ('default', 'linear', 'llama3')

CONFIG_KEYS = (
    ConfigKey('head_dim', -1, 'Llama: the size of each head; -1: embed_dim / num_heads (Qwen3 '
              'and some Mistrals differ).', exclusive=True),
    ConfigKey('qkv_bias', False, 'Llama: biases on the query / key / value projections (Qwen2).',
              exclusive=True),
    ConfigKey('qk_norm', False, 'Llama: RMSNorm on each query and key head before rotary (Qwen3).',
              exclusive=True),
    ConfigKey('rope_base', 10_000.0, 'Llama: rotary position embedding base.'),
    ConfigKey('rope_type', 'default', 'Llama: rotary frequencies: default | linear (positions / '
              "rope_factor) | llama3 (Llama 3.1's wavelength-dependent scaling: rope_factor, the "
              'two freq factors, rope_original_max_len).', exclusive=True),
    ConfigKey('rope_factor', 1.0, 'Llama: linear and llama3 rotary scaling factor.'),
    ConfigKey('rope_low_freq_factor', 1.0, 'Llama: llama3 rotary low_freq_factor.'),
    ConfigKey('rope_high_freq_factor', 4.0, 'Llama: llama3 rotary high_freq_factor.'),
    ConfigKey('rope_original_max_len', 8192, 'Llama: llama3 rotary, the pre-scaling context.'),
    ConfigKey('sliding_window', 0, 'Llama: attend only to this many most recent positions '
              '(Mistral); 0: all. The engine computes full causal attention, so a window shorter '
              'than the sequence is refused.', exclusive=True),
    *moe_config.CONFIG_KEYS,
    ConfigKey('hf_architecture', '', 'Llama: the Hugging Face architecture the model was loaded '
              "from and is exported as ('' : the family's own, LlamaForCausalLM); set by "
              'train.init_from=hf:DIR.', exclusive=True),
)


def check(model, mesh: dict[str, int]) -> None:
  """The rotary settings, the head size, and the mixture of experts (moe_config.check)."""
  require_finite(model, ['rope_base'])
  require_positive(model, ['rope_base'])
  choose(model, 'rope_type', ROPE_TYPES)
  if model.rope_type != 'default':
    require_positive(model, ['rope_factor'])
  if model.rope_type == 'llama3':
    require_positive(model, ['rope_low_freq_factor', 'rope_original_max_len'])
    if not model.rope_high_freq_factor > model.rope_low_freq_factor:
      raise ModelConfigError(
          f'model.rope_high_freq_factor={model.rope_high_freq_factor} must exceed '
          f'model.rope_low_freq_factor={model.rope_low_freq_factor} (llama3 interpolates between '
          'the two wavelengths).')
  if model.sliding_window < 0:
    raise ModelConfigError(f'model.sliding_window={model.sliding_window} must be >= 0 (0: none).')
  if model.head_dim != -1 and model.head_dim <= 0:
    raise ModelConfigError(f'model.head_dim={model.head_dim} must be positive, or -1 for '
                           'model.embed_dim / model.num_heads.')
  head_dim = model.head_dim if model.head_dim > 0 else model.embed_dim // model.num_heads
  if head_dim % 2:
    what = 'model.head_dim' if model.head_dim > 0 else 'model.embed_dim / model.num_heads'
    raise ModelConfigError(
        f'{what} = {head_dim} is odd; rotary embeddings rotate pairs of dimensions, so choose '
        'an even head size.')
  moe_config.check(model, mesh)
