"""The layouts and shapes the Pallas splash-attention kernel (model.attention='splash',
engine/models/splash.py) takes; engine.validation.validate calls `check_splash` before anything
is compiled, so that a kernel's shape error never surfaces from inside a trace."""

from __future__ import annotations

from ml_collections import ConfigDict

from engine.config import ConfigError
from engine.models import splash


def check_splash(config: ConfigDict, mesh: dict[str, int]) -> None:
  model = config.model
  if model.attention != 'splash':
    return
  if mesh['context'] > 1:
    raise ConfigError(
        f"model.attention='splash' with mesh.context={mesh['context']}: the kernel needs whole "
        "sequences and ring attention does not run it per block yet; set model.attention='einsum' "
        'or mesh.context=1.')
  if splash.block_size(config.data.seq_len) is None:
    raise ConfigError(
        f"model.attention='splash' needs data.seq_len divisible by 128 (the kernel's tile), not "
        f"{config.data.seq_len}; pick such a length or model.attention='einsum'.")
  if model.attention_scale_on != 'queries':
    raise ConfigError(
        f"model.attention='splash' with model.attention_scale_on={model.attention_scale_on!r}: "
        "the kernel cannot scale the logits; set model.attention_scale_on='queries'.")
