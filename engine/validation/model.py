"""The model section: the keys every model reads, checked here; the keys a model declares
itself (engine/models/__init__.py: MODEL_KEYS), checked by that model (MODEL_CHECKS) and refused
on a model that would ignore them; and the sizes the tensor and fsdp axes split."""

from __future__ import annotations

import math

from ml_collections import ConfigDict

from engine import models, parallel
from engine.config import DTYPES
from engine.errors import ConfigError
from engine.models.attention import spec as attention_spec
from engine.models.config_keys import ModelConfigError
from engine.validation.checks import (choose, require_divisible, require_finite,
                                      require_non_negative, require_positive)


def check_model(model: ConfigDict) -> None:
  """The shared keys, and no other model's exclusive key set on this one."""
  choose(model, 'dtype', 'model.dtype', DTYPES)
  choose(model, 'attention', 'model.attention', attention_spec.IMPLEMENTATIONS)
  choose(model, 'attention_scale_on', 'model.attention_scale_on', attention_spec.SCALE_ON)
  choose(model, 'remat', 'model.remat', tuple(parallel.steps.REMAT_POLICIES))
  require_finite(model, 'model', ['init_std', 'norm_eps'])
  require_positive(model, 'model', ['num_layers', 'num_heads', 'embed_dim', 'mlp_dim', 'max_len',
                                    'vocab_multiple', 'norm_eps', 'loss_chunks'])
  if model.vocab_size != -1 and model.vocab_size <= 0:
    raise ConfigError(f'model.vocab_size={model.vocab_size} must be positive, or -1 to '
                      'take it from the tokenizer.')
  require_non_negative(model, 'model', ['init_std'])
  if model.attention_scale != -1 and not (math.isfinite(model.attention_scale) and
                                          model.attention_scale > 0):
    raise ConfigError(f'model.attention_scale={model.attention_scale} must be a positive number, '
                      'or -1 for 1/sqrt(head_dim).')
  _check_foreign_keys(model)
  if model.head_dim == -1:  # No head size of its own (Llama's key): embed_dim over the heads.
    require_divisible(model.embed_dim, 'model.embed_dim', model.num_heads, 'model.num_heads')
  kv_heads = model.num_kv_heads
  if kv_heads != -1 and (kv_heads <= 0 or model.num_heads % kv_heads):
    raise ConfigError(
        f'model.num_kv_heads={kv_heads} must divide model.num_heads={model.num_heads} '
        '(each key/value head serves a group of query heads), or be -1 for one per query head.')


def _check_foreign_keys(model: ConfigDict) -> None:
  """An exclusive key of another model (ConfigKey.exclusive) left at its default: this model
  would ignore any other value."""
  own = {key.name for key in models.MODEL_KEYS.get(model.name, ())}
  for key in models.schema_keys():
    if key.exclusive and key.name not in own and model[key.name] != key.default:
      raise ConfigError(
          f'model.{key.name}={model[key.name]!r} is read by the '
          f'{" and ".join(models.owners(key.name))} model only; model.name={model.name!r} would '
          'ignore it: drop it.')


def check_model_keys(model: ConfigDict, mesh: dict[str, int]) -> None:
  """The configured model's check of its own keys against the mesh's sizes."""
  check = models.MODEL_CHECKS.get(model.name)
  if check is None:
    return
  try:
    check(model, mesh)
  except ModelConfigError as error:
    raise ConfigError(str(error)) from None


def check_model_splits(model: ConfigDict, mesh: dict[str, int]) -> None:
  """The model sizes the tensor and fsdp axes split (every parameter's split is checked once
  the model is laid out: check_layout)."""
  tensor = mesh['tensor']
  require_divisible(model.num_heads, 'model.num_heads', tensor, 'mesh.tensor')
  require_divisible(model.mlp_dim, 'model.mlp_dim', tensor, 'mesh.tensor')
  if model.vocab_size != -1:
    require_divisible(model.vocab_size, 'model.vocab_size', tensor, 'mesh.tensor')
  else:
    require_divisible(model.vocab_multiple, 'model.vocab_multiple', tensor, 'mesh.tensor')
  require_divisible(model.embed_dim, 'model.embed_dim', mesh['fsdp'], 'mesh.fsdp')


def check_loss_chunks(config: ConfigDict, mesh: dict[str, int]) -> None:
  """A chunked loss slices each device's positions (data.seq_len / mesh.context) evenly."""
  chunks, local = config.model.loss_chunks, config.data.seq_len // mesh['context']
  if chunks > 1 and local % chunks:
    raise ConfigError(
        f'model.loss_chunks={chunks} must divide the positions of a sequence on each device '
        f'(data.seq_len / mesh.context = {config.data.seq_len} / {mesh["context"]} = {local}); '
        'pick a divisor of it, or 1 for the whole sequence at once.')


def check_offload_platform(config: ConfigDict, platform: str) -> None:
  """What offloads to host memory, refused where it would do nothing: XLA:CPU compiles the step
  without the host memory space (its device memory is the host's)."""
  if platform != 'cpu':
    return
  if config.parallelism.offload_optimizer:
    raise ConfigError(
        'parallelism.offload_optimizer=True keeps the optimizer state in host memory, which '
        'XLA:CPU does not separate from device memory; use it on TPU or GPU (engine.plan '
        'compiles it for a TPU topology), or set it to False here.')
  model = config.model
  if model.remat in parallel.steps.REMAT_OFFLOADS:
    raise ConfigError(
        f'model.remat={model.remat!r} keeps the saved activations in host memory, which XLA:CPU '
        'does not separate from device memory (the step would keep them all the same); use it on '
        'TPU or GPU (engine.plan compiles it for a TPU topology), or '
        "model.remat='dots_with_no_batch_dims_saveable' here.")
