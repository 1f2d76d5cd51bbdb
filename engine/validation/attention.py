"""The layouts and shapes the Pallas splash-attention kernel (model.attention='splash',
engine/models/attention/splash.py) takes, alone or per block of manual mode's ring attention; and
the attention paths that compute a sliding window shorter than the sequence.
engine.validation.validate calls `check_splash` and `check_window` before anything is compiled, so
that a kernel's shape error never surfaces from inside a trace."""

from __future__ import annotations

from ml_collections import ConfigDict

from engine.errors import ConfigError
from engine.models.attention import splash


def check_splash(config: ConfigDict, mesh: dict[str, int]) -> None:
  model = config.model
  if model.attention != 'splash':
    return
  if mesh['context'] > 1:
    _check_splash_ring(config, mesh['context'])
  if splash.block_size(config.data.seq_len) is None:
    raise ConfigError(
        f"model.attention='splash' needs data.seq_len divisible by 128 (the kernel's tile), not "
        f"{config.data.seq_len}; pick such a length or model.attention='einsum'.")
  if model.attention_scale_on != 'queries':
    raise ConfigError(
        f"model.attention='splash' with model.attention_scale_on={model.attention_scale_on!r}: "
        "the kernel cannot scale the logits; set model.attention_scale_on='queries'.")


def check_window(config: ConfigDict, mesh: dict[str, int]) -> None:
  """A sliding window shorter than the sequence needs the einsum attention over whole sequences
  (auto mode's sequence split included); the other paths compute full causal attention."""
  model, seq_len = config.model, config.data.seq_len
  window = model.get('sliding_window', 0)
  if not 0 < window < seq_len:
    return
  refused = [(model.attention != 'einsum', f'model.attention={model.attention!r}',
              "model.attention='einsum'"),
             (mesh.get('context', 1) > 1 and config.parallelism.mode == 'manual',
              f"mesh.context={mesh.get('context')} in manual mode (ring attention)",
              'parallelism.mode=auto or mesh.context=1'),
             (model.get('mla_kv_rank', 0) > 0, 'latent attention (model.mla_kv_rank)', '')]
  for given, what, fix in refused:
    if given:
      raise ConfigError(
          f'model.sliding_window={window} is shorter than data.seq_len={seq_len}, and {what} '
          'computes full causal attention, which differs from the window once a sequence is '
          f'longer than it; use data.seq_len <= {window}' + (f', or {fix}.' if fix else '.'))


def _check_splash_ring(config: ConfigDict, context: int) -> None:
  """Context parallelism runs the kernel per (query chunk, key chunk) block of manual mode's
  ring attention; auto mode's sequence split would need the compiler to partition it."""
  if config.parallelism.mode != 'manual':
    raise ConfigError(
        f"model.attention='splash' with mesh.context={context} in auto mode: the kernel needs "
        "whole sequences or ring attention's blocks; set parallelism.mode='manual' (ring "
        "attention runs it per block), model.attention='einsum' or mesh.context=1.")
  seq_len, parts = config.data.seq_len, 2 * context
  if seq_len % parts or splash.block_size(seq_len // parts) is None:
    raise ConfigError(
        f"model.attention='splash' with mesh.context={context} needs data.seq_len divisible by "
        f"2*mesh.context*128={parts * 128} (ring attention runs the kernel on chunks of "
        f"data.seq_len / (2*mesh.context) positions, tiles of 128), not {seq_len}; pick such a "
        "length or model.attention='einsum'.")
