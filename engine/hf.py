"""Hugging Face checkpoints in and out: `train.init_from=hf:PATH` and `engine.export`.

A checkpoint is a directory with `config.json` and `*.safetensors` files (one, or several named
by `model.safetensors.index.json`). Which tensor holds which parameter, in which layout, is the
model family's knowledge (its `HFFormat`, engine/models/hf_format.py, registered in
engine/models/__init__.py); this module only reads and writes safetensors. Loading builds every
parameter with `jax.make_array_from_callback`: each device's block is read from the files as that
slice alone (safetensors reads slices without loading the tensor), so no host or device ever
holds a whole parameter it does not own.
"""

from __future__ import annotations

import itertools
import json
import os

import jax
import numpy as np
from absl import logging
from safetensors import safe_open
from safetensors.numpy import save_file

from engine import models
from engine.config import ConfigError
from engine.models.hf_format import LAYER_NDIM, HFFormat, UnsupportedCheckpoint

PREFIX = 'hf:'


def path_of(init_from: str) -> str | None:
  """The checkpoint directory of `train.init_from=hf:PATH`, or None for a workdir."""
  return init_from[len(PREFIX):] if init_from.startswith(PREFIX) else None


def read_config(path: str) -> dict:
  config_file = os.path.join(path, 'config.json')
  if not os.path.isfile(config_file):
    raise ConfigError(f'train.init_from=hf:{path}: no config.json there; pass a directory '
                      'holding a Hugging Face checkpoint (config.json and *.safetensors).')
  with open(config_file) as f:
    return json.load(f)


def format_of(hf: dict, where: str) -> HFFormat:
  """The HFFormat of the architecture a config.json names."""
  architectures = hf.get('architectures') or []
  fmt = models.hf_format_of_architectures(architectures)
  if fmt is None:
    raise ConfigError(f'{where}: model_type={hf.get("model_type")!r}, architectures='
                      f'{architectures}; the engine loads {", ".join(sorted(models.HF_FORMATS))} '
                      'checkpoints.')
  return fmt


def model_config(hf: dict, where: str) -> dict:
  """The engine's `model` settings for a Hugging Face config.json; ConfigError for anything
  the model family does not compute the same way."""
  fmt = format_of(hf, where)
  try:
    return fmt.to_model_config(hf, where)
  except UnsupportedCheckpoint as e:
    raise ConfigError(str(e)) from None
  except (KeyError, TypeError, ValueError) as e:
    raise ConfigError(f'{where}: config.json lacks or garbles {e} for {fmt.architecture}.') from None


def apply_model_config(config) -> None:
  """For `train.init_from=hf:PATH`: the model settings come from PATH/config.json."""
  path = path_of(config.train.init_from)
  if path is None:
    return
  settings = model_config(read_config(path), f'train.init_from=hf:{path}')
  for key, value in settings.items():
    if config.model[key] != value:
      logging.info('model.%s=%r from %s/config.json', key, value, path)
      config.model[key] = value


class _Files:
  """Every tensor of a checkpoint, by name, read in slices."""

  def __init__(self, path: str):
    index = os.path.join(path, 'model.safetensors.index.json')
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f)['weight_map']
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))
      weight_map = None
    if not files:
      raise ConfigError(f'train.init_from=hf:{path}: no *.safetensors files there.')
    self.handles = {f: safe_open(os.path.join(path, f), framework='numpy') for f in files}
    self.where = weight_map or {name: f for f, h in self.handles.items() for name in h.keys()}
    self.path = path

  def has(self, name: str) -> bool:
    return name in self.where

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    return self.handles[self.where[name]].get_slice(name)[index]


def _span(heads: slice, size: int) -> slice:
  """The rows of a [heads * size] dimension that hold heads[...], whole heads."""
  return slice(heads.start * size, heads.stop * size)


def _read_block(files: _Files, name: str, layout: str, index: tuple[slice, ...],
                shape: tuple[int, ...]) -> np.ndarray:
  """The engine-layout block `index` (of an engine array of `shape`) of HF tensor `name`."""
  index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
  if layout == 'same':
    return files.read(name, index)
  if layout == 'linear':
    return files.read(name, index[::-1]).T
  if layout == 'heads_out':  # Engine [D, H, K] from [H K, D].
    d, h, k = index
    block = files.read(name, (_span(h, shape[2]), d))
    block = block.reshape(h.stop - h.start, shape[2], -1)[:, k]
    return block.transpose(2, 0, 1)
  if layout == 'heads_bias':  # Engine [H, K] from [H K].
    h, k = index
    return files.read(name, (_span(h, shape[1]),)).reshape(h.stop - h.start, shape[1])[:, k]
  assert layout == 'heads_in', layout  # Engine [H, K, D] from [D, H K].
  h, k, d = index
  block = files.read(name, (d, _span(h, shape[1])))
  block = block.reshape(-1, h.stop - h.start, shape[1])[:, :, k]
  return block.transpose(1, 2, 0)


def _path(keys) -> str:
  return '/'.join(str(getattr(k, 'key', k)) for k in keys)


def by_path(params) -> dict[str, object]:
  """A nested parameter dict's leaves by '/'-joined engine path ('blocks/w_q_DHK')."""
  return {_path(keys): leaf for keys, leaf in jax.tree_util.tree_leaves_with_path(params)}


def load_params(path: str, abstract_params):
  """The checkpoint's parameters, each created in the sharding `abstract_params` carries."""
  fmt = format_of(read_config(path), f'train.init_from=hf:{path}')
  files = _Files(path)
  flat = by_path(abstract_params)
  unknown = set(flat) - {t.path for t in fmt.tensors}
  if unknown:
    raise ConfigError(f'train.init_from=hf:{path}: the model has parameters no '
                      f'{fmt.architecture} tensor maps to: {sorted(unknown)}.')
  loaded, tied = {}, False
  for tensor in fmt.tensors:
    if tensor.path not in flat:
      continue  # A tensor this model does not have (biases, q/k norms).
    target = flat[tensor.path]
    name, layout = tensor.name, tensor.layout
    if tensor.tied_to and not files.has(name):
      name, layout, tied = tensor.tied_to, 'linear', True
    lead = target.shape[:target.ndim - LAYER_NDIM[layout]] if '{i}' in name else ()
    inner = target.shape[len(lead):]

    def block(index, name=name, layout=layout, lead=lead, inner=inner, dtype=target.dtype):
      if not lead:
        return _read_block(files, name, layout, index, inner).astype(dtype)
      # The stacked dimensions: [L], or [R, L / R] grouped; layer = their row-major position.
      ranges = [range(*s.indices(n)) for s, n in zip(index[:len(lead)], lead)]
      layers = [_read_block(files, name.format(i=int(np.ravel_multi_index(at, lead))), layout,
                            index[len(lead):], inner)
                for at in itertools.product(*ranges)]
      return np.stack(layers).reshape(*map(len, ranges), *layers[0].shape).astype(dtype)

    _check_shape(files, name, layout, inner, path)
    loaded[tensor.path] = jax.make_array_from_callback(target.shape, target.sharding, block)
  logging.info('Loaded %d tensors from %s%s', len(loaded), path,
               ' (output head tied to the embedding)' if tied else '')
  return jax.tree_util.tree_map_with_path(lambda keys, _: loaded[_path(keys)], abstract_params)


def _check_shape(files: _Files, name: str, layout: str, inner: tuple[int, ...], path: str):
  first = name.format(i=0)
  if not files.has(first):
    raise ConfigError(f'train.init_from=hf:{path}: tensor {first!r} is missing.')
  expected = _hf_shape(layout, inner)
  if files.shape(first) != expected:
    raise ConfigError(f'train.init_from=hf:{path}: {first!r} is {files.shape(first)}, the model '
                      f'needs {expected}; the config.json and the weights disagree.')


def _hf_shape(layout: str, inner: tuple[int, ...]) -> tuple[int, ...]:
  if layout == 'same':
    return inner
  if layout == 'linear':
    return inner[::-1]
  if layout == 'heads_out':
    return (inner[1] * inner[2], inner[0])
  if layout == 'heads_bias':
    return (inner[0] * inner[1],)
  return (inner[2], inner[0] * inner[1])


def to_hf(layout: str, array: np.ndarray) -> np.ndarray:
  """One layer's engine array in the Hugging Face layout (the inverse of _read_block)."""
  if layout == 'same':
    return array
  if layout == 'linear':
    return array.T
  if layout == 'heads_out':  # [D, H, K] -> [H K, D]
    return array.reshape(array.shape[0], -1).T
  if layout == 'heads_bias':  # [H, K] -> [H K]
    return array.reshape(-1)
  return array.reshape(-1, array.shape[-1]).T  # [H, K, D] -> [D, H K]


def save(params: dict[str, np.ndarray], model_config, vocab_size: int, out: str) -> list[str]:
  """Writes `config.json` and `model.safetensors` of the model family's Hugging Face format
  (params: engine '/'-paths -> host arrays; stacked parameters [L, ...], or grouped
  [R, L / R, ...]). Returns the tensor names written."""
  fmt = models.hf_format_for(model_config)
  config = fmt.to_hf_config(model_config, vocab_size)
  tensors = {}
  for tensor in fmt.tensors:
    array = np.asarray(params[tensor.path])
    if '{i}' not in tensor.name:
      tensors[tensor.name] = to_hf(tensor.layout, array)
      continue
    per_layer = array.reshape(-1, *array.shape[array.ndim - LAYER_NDIM[tensor.layout]:])
    for i, layer in enumerate(per_layer):
      tensors[tensor.name.format(i=i)] = np.ascontiguousarray(to_hf(tensor.layout, layer))
  os.makedirs(out, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
  with open(os.path.join(out, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  logging.info('Wrote %d tensors (%.1f MB) to %s', len(tensors),
               sum(v.nbytes for v in tensors.values()) / 1e6, out)
  return sorted(tensors)

