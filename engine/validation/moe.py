"""A mixture of experts (engine/models/moe/layer.py) against the mesh and the mode: the expert mesh
axis, and the layouts the layer does not support yet. engine.validation.validate calls
`check_moe` after the model's own check of its keys (engine/models/moe/config.py)."""

from __future__ import annotations

from ml_collections import ConfigDict

from engine.errors import ConfigError


def check_moe(config: ConfigDict, mesh: dict[str, int]) -> None:
  """An expert axis only with experts to split, then the meshes the layer's batch statistics
  are exact on. The experts' own keys, and their split over the expert axis, are the model's
  check (engine/models/moe/config.py)."""
  model = config.model
  if not model.num_experts:
    if mesh['expert'] > 1:  # `expert` splits the batch too, so no unused-axis check sees it.
      raise ConfigError(
          f"mesh.expert={mesh['expert']} splits a mixture of experts, but model "
          f'{model.name!r} is dense (model.num_experts=0); set mesh.expert=1 (mesh.data splits '
          'the batch), or give the llama model experts.')
    return
  _check_layout(config, mesh)


def _check_layout(config: ConfigDict, mesh: dict[str, int]) -> None:
  """The layouts that would compute something else than the one-device model: manual mode's
  capacity with context parallelism would count only this device's part of each sequence.
  Pipeline stages are fine: like micro-batches, they compute the balance loss per micro-batch
  (docs/configuration.md)."""
  # Capacity is counted per sequence; a device holding part of every sequence cannot count it.
  if (config.parallelism.mode == 'manual' and mesh['context'] > 1 and
      config.model.moe_dispatch == 'capacity'):
    raise ConfigError(
        f"model.moe_dispatch='capacity' in manual mode with mesh.context={mesh['context']} is "
        "not supported yet; use model.moe_dispatch='dropless', parallelism.mode=auto, or "
        'mesh.context=1.')
