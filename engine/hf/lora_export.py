"""A LoRA run's adapters written out (engine/models/llama/lora.py): merged into the weights of a
Hugging Face checkpoint, or as a PEFT adapter (adapter_config.json and adapter_model.safetensors)
that `peft.PeftModel.from_pretrained` loads onto the base checkpoint.

PEFT's adapter of a linear layer y = x W^T holds lora_A.weight [r, in] and lora_B.weight [out, r]
and adds (lora_alpha / r) x A^T B^T; the engine's A [*in, r] and B [r, *out] are those, flattened
in the order the checkpoint flattens the weight's dimensions (heads, then head_dim).
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from engine.models.llama import lora
from engine.models.formats.interface import first_layer, tensor_name

def _adapted(host: dict[str, np.ndarray], cfg: lora.LoraConfig):
  """(weight path, its A, its B, input dimensions) of each adapted projection."""
  for name in cfg.targets:
    weight, in_dims, _ = lora.TARGETS[name]
    for path in [p for p in host if p.rsplit('/', 1)[-1] == weight]:
      a_name, b_name = lora.adapter_names(weight)
      prefix = path.rsplit('/', 1)[0] + '/'
      yield path, host[prefix + a_name], host[prefix + b_name], in_dims


def merged(host: dict[str, np.ndarray], cfg: lora.LoraConfig) -> dict[str, np.ndarray]:
  """The parameters with each adapted weight replaced by W + scale A B (in float64, then the
  weight's dtype) and the adapters left out."""
  out = {p: v for p, v in host.items() if not lora.is_adapter(p)}
  for path, a, b, in_dims in _adapted(host, cfg):
    w = host[path]
    lead = a.ndim - in_dims - 1  # Stacked layers (and groups).
    rank = a.shape[-1]
    a2 = a.reshape(*a.shape[:lead], -1, rank).astype(np.float64)
    b2 = b.reshape(*b.shape[:lead], rank, -1).astype(np.float64)
    out[path] = (w.astype(np.float64) + cfg.scale * (a2 @ b2).reshape(w.shape)).astype(w.dtype)
  return out


def save_adapter(host: dict[str, np.ndarray], fmt, cfg: lora.LoraConfig, out: str,
                 base_model: str, dtype) -> list[str]:
  """Writes the PEFT adapter of `host`'s adapters into `out`; returns the tensor names."""
  names = {t.path: t.name for t in fmt.tensors}
  shapes = {path: np.shape(array) for path, array in host.items()}
  tensors = {}
  for path, a, b, in_dims in _adapted(host, cfg):
    lead = a.shape[:a.ndim - in_dims - 1]  # Stacked layers (and groups).
    rank = a.shape[-1]
    for at in np.ndindex(*lead):
      module = tensor_name(names[path], lead, at, first_layer(path, shapes)).rsplit('.', 1)[0]
      prefix = f'base_model.model.{module}'
      a_in = a[at].reshape(-1, rank)  # [in, r]
      b_out = b[at].reshape(rank, -1)  # [r, out]
      tensors[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a_in.T).astype(dtype)
      tensors[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(b_out.T).astype(dtype)
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, 'adapter_model.safetensors'), metadata={'format': 'pt'})
  config = {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base_model,
      'r': cfg.rank, 'lora_alpha': cfg.alpha, 'target_modules': sorted(cfg.targets),
      'lora_dropout': 0.0, 'bias': 'none', 'fan_in_fan_out': False, 'use_rslora': False,
      'use_dora': False, 'inference_mode': True, 'modules_to_save': None,
      'init_lora_weights': True, 'layers_to_transform': None, 'rank_pattern': {},
      'alpha_pattern': {}}
  with open(os.path.join(out, 'adapter_config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  return sorted(tensors)
