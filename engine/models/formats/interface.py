"""How a model family describes its Hugging Face checkpoints: the interface engine/hf/load.py reads.

A family that can load and save Hugging Face checkpoints registers an `HFFormat` in
engine/models/__init__.py (`HF_FORMATS`). It names each of its parameters' Hugging Face tensor and
layout, and translates the checkpoint's config.json to and from its `model` config keys.
engine/hf/load.py then only reads and writes safetensors, slice by slice; it knows no parameter
name.

Layouts (Hugging Face's `nn.Linear` weights are [out, in]; the engine's are [in, out], with heads
split out and stacked layers along leading axes):
  same       identical layout;
  linear     transposed: [out, in] -> [in, out];
  heads_out  [H K, D] -> [D, H, K] (a projection into heads);
  heads_in   [D, H K] -> [H, K, D] (a projection out of heads);
  heads_bias [H K] -> [H, K] (a bias on a projection into heads);
  plus_one   identical layout, the engine's value one more (Gemma's RMSNorm multiplies by 1 + w,
             the engine's by its scale; added and subtracted in float32).
A stacked parameter's name has '{i}' for its layer (counted on from the stacks before its own,
STACKS); a parameter stacked over experts too (a
mixture of experts' [L, E, ...] weights, one tensor per layer and expert) also has '{e}', the
expert: the last of its leading dimensions (`tensor_name`).
A format lists every tensor any of its models may have; a model that lacks a parameter (no
biases, no q/k norms) reads none of that entry's tensors, and a checkpoint tensor that no
parameter of the model reads is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

LAYOUTS = ('same', 'linear', 'heads_out', 'heads_in', 'heads_bias', 'plus_one')
# Dimensions of one layer's engine array, by layout (stacked parameters have more in front).
LAYER_NDIM = {'same': 1, 'linear': 2, 'heads_out': 3, 'heads_in': 3, 'heads_bias': 2,
              'plus_one': 1}


class UnsupportedCheckpoint(ValueError):
  """A checkpoint the family cannot reproduce exactly; the message names the key (engine/hf/load.py
  reports it as a config error)."""


@dataclasses.dataclass(frozen=True)
class HFTensor:
  """One engine parameter and the Hugging Face tensor(s) it holds."""
  path: str  # '/'-joined engine path.
  # Hugging Face name; '{i}' stands for the layer of a stacked parameter, '{e}' for the expert.
  name: str
  layout: str  # One of LAYOUTS.
  # A tied checkpoint has no `name`: the parameter is read from this tensor instead, transposed
  # (an output head tied to the embedding).
  tied_to: str | None = None


@dataclasses.dataclass(frozen=True)
class HFFormat:
  """A model family's Hugging Face checkpoints of one architecture."""
  architecture: str  # config.json's `architectures` entry, e.g. 'LlamaForCausalLM'.
  model: str  # The engine model (model.name) that computes it.
  tensors: tuple[HFTensor, ...]
  # (config.json dict, where it came from) -> the engine's `model` settings; raises
  # UnsupportedCheckpoint (naming the key) for anything the family does not compute the same way.
  to_model_config: Callable[[dict, str], dict]
  # (the engine's `model` config, vocabulary size) -> config.json.
  to_hf_config: Callable[[object, int], dict]
  moe: bool = False  # Its models are mixtures of experts (model.num_experts > 0).
  latent: bool = False  # Its models attend through a latent (model.mla_kv_rank > 0).
  # (the engine's `model` config) -> '' if this architecture writes the model exactly, else what
  # it cannot write (engine.export refuses it); None: every model of `model`.
  unwritable: Callable[[object], str] | None = None


# Stacks whose layers Hugging Face numbers in one sequence, in this order: a mixture of experts'
# dense first layers (DeepSeek-V3), then the stacked layers.
STACKS = ('dense_blocks/', 'blocks/')


def first_layer(path: str, shapes: dict[str, tuple[int, ...]]) -> int:
  """The Hugging Face number of the first layer of the stack `path` belongs to: the depth of the
  stacks before it (`shapes`: the model's parameter shapes by path)."""
  stack = next((s for s in STACKS if path.startswith(s)), None)
  if stack is None:
    return 0
  return sum(next((shape[0] for p, shape in shapes.items() if p.startswith(before)), 0)
             for before in STACKS[:STACKS.index(stack)])


def tensor_name(name: str, lead: tuple[int, ...], at: tuple[int, ...], first: int = 0) -> str:
  """The Hugging Face name of the stacked parameter's slice at position `at` of its leading
  dimensions `lead` ([L], or [R, L / R] grouped; then [E] if the name has '{e}'): the layer is
  `first` (first_layer) plus the row-major position of the layer dimensions."""
  if '{e}' in name:
    return name.format(i=first + int(np.ravel_multi_index(at[:-1], lead[:-1])), e=int(at[-1]))
  return name.format(i=first + int(np.ravel_multi_index(at, lead)))
