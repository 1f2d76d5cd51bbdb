"""The keys only the Llama family reads (engine/models/llama/model.py; its mixture of experts':
engine/models/moe/config.py) and their checks, declared apart from the model so that
engine.config reads them without JAX."""

from __future__ import annotations

from engine.models.moe import config as moe_config
from engine.models.config_keys import (ConfigKey, ModelConfigError, choose, require_finite,
                                       require_positive)

ROPE_TYPES = ('default', 'linear', 'llama3')
MLP_ACTIVATIONS = ('silu', 'gelu_tanh')
# The projections LoRA adapts, by PEFT's names (engine/models/llama/lora.py).
LORA_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')

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
    ConfigKey('sliding_window', 0, 'Llama: attend only to this many most recent positions, '
              'itself included (Mistral; with model.global_every, the local layers); 0: all. The '
              'einsum attention and generation compute it; with the other attentions, ring '
              'attention or latent attention a window shorter than the sequence is refused.',
              exclusive=True),
    ConfigKey('global_every', 0, 'Llama: every this many-th layer (layers n - 1, 2n - 1, ...) '
              'attends globally and the others within model.sliding_window with their own rotary '
              'base (model.rope_local_base): Gemma 2: 2, Gemma 3: 6; 0: every layer alike.',
              exclusive=True),
    ConfigKey('rope_local_base', 0.0, 'Llama: the rotary base of the layers model.global_every '
              'makes local (Gemma 3: 10000), the global ones keeping model.rope_*; 0: the same '
              'rotary in every layer.', exclusive=True),
    ConfigKey('post_norms', False, "Llama: RMSNorm on the attention's and the MLP's outputs too, "
              'before each residual add (Gemma 2 / 3).', exclusive=True),
    ConfigKey('mlp_activation', 'silu', "Llama: the gated MLP's activation: " +
              ' | '.join(MLP_ACTIVATIONS) + ' (SwiGLU; GeGLU with tanh-approximated GELU, Gemma).',
              exclusive=True),
    ConfigKey('embed_scale', False, 'Llama: the embeddings multiplied by sqrt(embed_dim), '
              'rounded to their dtype (Gemma).', exclusive=True),
    ConfigKey('attention_softcap', 0.0, 'Llama: the scaled attention logits capped softly, '
              'c tanh(logits / c), before the mask (Gemma 2: 50; the einsum attention, ring '
              'attention and generation compute it); 0: none.', exclusive=True),
    ConfigKey('logit_softcap', 0.0, 'Llama: the output logits capped softly, c tanh(logits / c) '
              '(Gemma 2: 30); 0: none.', exclusive=True),
    ConfigKey('mla_kv_rank', 0, "Llama: multi-head latent attention (DeepSeek-V2 / V3, "
              'engine/models/llama/latent_attention.py): keys and values from a latent of this size '
              "per position (DeepSeek's kv_lora_rank); 0: the Llama attention.", exclusive=True),
    ConfigKey('mla_q_rank', 0, "Llama MLA: the queries' own latent size (q_lora_rank); 0: "
              'queries projected from the input directly.', exclusive=True),
    ConfigKey('mla_rope_dim', 64, "Llama MLA: each query's rotary part and the one rotary key "
              "shared by the heads (qk_rope_head_dim); head_dim is the rest (qk_nope_head_dim).",
              exclusive=True),
    ConfigKey('mla_value_dim', 0, "Llama MLA: each head's value size (v_head_dim); 0: "
              'head_dim.', exclusive=True),
    ConfigKey('mla_rope_interleave', True, "Llama MLA: rotary pairs dimensions 2i and 2i + 1 "
              "(DeepSeek's checkpoints, rope_interleave) rather than i and i + R / 2.",
              exclusive=True),
    ConfigKey('lora_rank', 0, 'Llama: LoRA, low-rank adapters of this rank on the '
              'model.lora_targets projections, every other parameter frozen '
              '(engine/models/llama/lora.py); 0: none.', exclusive=True),
    ConfigKey('lora_alpha', 16.0, 'Llama LoRA: the adapters\' product is scaled by '
              'lora_alpha / lora_rank (PEFT\'s lora_alpha).', exclusive=True),
    ConfigKey('lora_targets', ','.join(LORA_TARGETS), 'Llama LoRA: the projections to adapt, '
              "comma-separated PEFT names (any of " + ', '.join(LORA_TARGETS) + ').',
              exclusive=True),
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
  _check_latent_attention(model, mesh)
  moe_config.check(model, mesh)
  _check_lora(model)
  _check_gemma(model)


def lora_targets(model) -> tuple[str, ...]:
  """model.lora_targets' names."""
  return tuple(t.strip() for t in model.lora_targets.split(',') if t.strip())


def _check_lora(model) -> None:
  if model.lora_rank < 0:
    raise ModelConfigError(f'model.lora_rank={model.lora_rank} must be >= 0 (0: no LoRA).')
  if not model.lora_rank:
    return
  require_finite(model, ['lora_alpha'])
  require_positive(model, ['lora_alpha'])
  targets = lora_targets(model)
  unknown = [t for t in targets if t not in LORA_TARGETS]
  if unknown or not targets:
    raise ModelConfigError(
        f'model.lora_targets={model.lora_targets!r}: ' +
        (f'{unknown[0]!r} names no projection' if unknown else 'names no projection') +
        f'; name any of {", ".join(LORA_TARGETS)}, comma-separated.')
  mlp = [t for t in targets if t in LORA_TARGETS[4:]]
  if model.num_experts and mlp:
    raise ModelConfigError(
        f'model.lora_targets names {mlp[0]!r}, but model.num_experts={model.num_experts} puts '
        'experts in place of the MLP projections; adapt the attention projections only '
        '(q_proj,k_proj,v_proj,o_proj).')
  if model.mla_kv_rank:
    raise ModelConfigError('model.lora_rank with latent attention (model.mla_kv_rank > 0) is '
                           'not supported: its projections are not the ones LoRA adapts; '
                           'fine-tune it whole (model.lora_rank=0).')


def _check_gemma(model) -> None:
  """Gemma's options: the soft caps, the activation, and the local layers' pattern and rotary."""
  require_finite(model, ['attention_softcap', 'logit_softcap', 'rope_local_base'])
  for key in ('attention_softcap', 'logit_softcap', 'rope_local_base', 'global_every'):
    if model[key] < 0:
      raise ModelConfigError(f'model.{key}={model[key]} must be >= 0 (0: none).')
  choose(model, 'mlp_activation', MLP_ACTIVATIONS)
  if model.attention_softcap and model.attention != 'einsum':
    raise ModelConfigError(
        f'model.attention_softcap={model.attention_softcap} with model.attention='
        f'{model.attention!r}: only the einsum attention caps the logits; set '
        "model.attention='einsum'.")
  if model.rope_local_base and not model.global_every:
    raise ModelConfigError(
        f'model.rope_local_base={model.rope_local_base} needs model.global_every > 0 (which '
        'layers are local); set it, or model.rope_local_base=0.')
  if model.global_every and (model.num_experts or model.mla_kv_rank):
    raise ModelConfigError(
        f'model.global_every={model.global_every} with '
        + ('model.num_experts' if model.num_experts else 'model.mla_kv_rank') +
        ': local and global layers are built for the dense Llama attention and MLP; set '
        'model.global_every=0.')
  if model.mlp_activation != 'silu' and model.num_experts:
    raise ModelConfigError(
        f"model.mlp_activation={model.mlp_activation!r} with model.num_experts="
        f'{model.num_experts}: the experts compute SwiGLU; set model.mlp_activation=silu.')


def _check_latent_attention(model, mesh: dict[str, int]) -> None:
  """MLA's sizes, and what it does not combine with (the Llama attention's own options, the
  kernels and the ring attention written for equal key and value heads)."""
  for key in ('mla_kv_rank', 'mla_q_rank', 'mla_value_dim'):
    if model[key] < 0:
      raise ModelConfigError(f'model.{key}={model[key]} must be >= 0 (0: see the key\'s help).')
  if not model.mla_kv_rank:
    return
  if model.mla_rope_dim <= 0 or model.mla_rope_dim % 2:
    raise ModelConfigError(f'model.mla_rope_dim={model.mla_rope_dim} must be a positive even '
                           'number (rotary embeddings turn pairs of dimensions; DeepSeek-V3: 64).')
  refused = [(model.qkv_bias, 'model.qkv_bias=True'), (model.qk_norm, 'model.qk_norm=True'),
             (model.attention != 'einsum', f'model.attention={model.attention!r}'),
             (model.attention_scale != -1, f'model.attention_scale={model.attention_scale}'),
             (model.attention_softcap, f'model.attention_softcap={model.attention_softcap}'),
             (mesh.get('context', 1) > 1, f"mesh.context={mesh.get('context')}")]
  for given, what in refused:
    if given:
      raise ModelConfigError(
          f'model.mla_kv_rank={model.mla_kv_rank} (multi-head latent attention) with {what}: '
          'latent attention runs the einsum attention on whole sequences, scaled by 1 / '
          'sqrt(head_dim + mla_rope_dim), without q/k/v biases, q/k norms or a logit cap; drop '
          'that setting or set model.mla_kv_rank=0.')
