"""Hugging Face checkpoints in: `train.init_from=hf:PATH` (engine/hf/save.py writes them out).

A checkpoint is a directory with `config.json` and `*.safetensors` files (one, or several named
by `model.safetensors.index.json`). Which tensor holds which parameter, in which layout, is the
model family's knowledge (its `HFFormat`, engine/models/formats/interface.py, registered in
engine/models/__init__.py); this module only reads config.json and safetensors. Loading builds every
parameter with `jax.make_array_from_callback`: each device's block is read from the files as that
slice alone (safetensors reads slices without loading the tensor), so no host or device ever
holds a whole parameter it does not own. Before anything is read, the files are checked against
the model from their headers: every tensor of every layer there, in its shape and a float dtype,
and nothing there that no parameter reads (buffers such as `rotary_emb.inv_freq` aside); a
disagreement is one ConfigError line.

Saving writes `config.json`, `generation_config.json` and `model.safetensors` (float32, bfloat16
or float16), and `save_tokenizer` the run's tokenizer files, as transformers' Auto classes load
them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re

import jax
import numpy as np
from absl import logging
from safetensors import safe_open

from engine import config as config_lib
from engine import models
from engine.data import manifest_paths as paths
from engine.errors import ConfigError
from engine.models.formats.interface import (LAYER_NDIM, HFFormat, UnsupportedCheckpoint,
                                             first_layer, tensor_name)

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
    raise ConfigError(
        f'{where}: config.json lacks or garbles {e} for {fmt.architecture}.') from None


def _model_values(config) -> dict[str, object]:
  """For `train.init_from=hf:PATH`: the model settings PATH/config.json gives that differ from
  the config's, as dotted keys for engine.config.with_values ({} without an hf: init_from)."""
  path = path_of(config.train.init_from)
  if path is None:
    return {}
  values = {}
  for key, value in model_config(read_config(path), f'train.init_from=hf:{path}').items():
    if config.model[key] != value:
      logging.info('model.%s=%r from %s/config.json', key, value, path)
      values[f'model.{key}'] = value
  return values


def with_model_config(config):
  """A copy of `config` whose model settings are PATH/config.json's for `train.init_from=hf:PATH`
  (the config itself is left as it was)."""
  return config_lib.with_values(config, _model_values(config))


class _Files:
  """Every tensor of a checkpoint, by name, read in slices."""

  def __init__(self, path: str):
    self.path, self.where_text = path, f'train.init_from=hf:{path}'
    index = os.path.join(path, 'model.safetensors.index.json')
    if os.path.isfile(index):
      try:
        with open(index) as f:
          files = sorted(set(json.load(f)['weight_map'].values()))
      except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f'{self.where_text}: model.safetensors.index.json has no readable '
                          f'weight_map ({e}); rewrite it or remove it.') from None
      for f in files:
        paths.inside(path, f, f'{self.where_text}: model.safetensors.index.json')
      absent = [f for f in files if not os.path.isfile(os.path.join(path, f))]
      if absent:
        raise ConfigError(f'{self.where_text}: model.safetensors.index.json names {len(absent)} '
                          f'file(s) not there, e.g. {absent[0]!r}; the download is incomplete.')
    else:
      files = sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))
    if not files:
      raise ConfigError(f'{self.where_text}: no *.safetensors files there.')
    self.handles = {}
    for f in files:
      try:
        self.handles[f] = safe_open(os.path.join(path, f), framework='numpy')
      except Exception as e:  # safetensors raises its own error type for a damaged file.
        raise ConfigError(f'{self.where_text}: {f} is not a readable safetensors file '
                          f'({str(e).splitlines()[0] if str(e) else type(e).__name__}); '
                          'download it again.') from None
    # Where each tensor is, from the files themselves (an index may name more than they hold).
    self.where = {name: f for f, h in self.handles.items() for name in h.keys()}

  def names(self) -> set[str]:
    return set(self.where)

  def has(self, name: str) -> bool:
    return name in self.where

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

  def dtype(self, name: str) -> str:
    return self.handles[self.where[name]].get_slice(name).get_dtype()

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
  if layout == 'plus_one':
    return files.read(name, index).astype(np.float32) + 1
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


# Tensors Hugging Face checkpoints may hold that are not weights (buffers older versions saved).
NOT_WEIGHTS = ('rotary_emb.inv_freq',)
# The safetensors dtypes a parameter is read from.
FLOAT_DTYPES = ('F32', 'BF16', 'F16', 'F64')


@dataclasses.dataclass(frozen=True)
class _Read:
  """One parameter and the checkpoint tensor(s) it is read from."""
  path: str  # Engine path.
  name: str  # Hugging Face name, '{i}' for the layer of a stacked parameter, '{e}' the expert.
  layout: str
  # The stacked dimensions ([L], or [R, L / R]; then [E] with '{e}'); () if not stacked.
  lead: tuple[int, ...]
  inner: tuple[int, ...]  # One layer's (one expert's) engine shape.
  first: int = 0  # Hugging Face's number of its first layer (hf_format.first_layer).

  def names(self) -> list[str]:
    if not self.lead:
      return [self.name]
    return [tensor_name(self.name, self.lead, at, self.first) for at in np.ndindex(*self.lead)]


def _reads(fmt: HFFormat, files: _Files, flat: dict, tie: bool) -> list[_Read]:
  """What each parameter of the model reads: its tensor, or the one a tied head is read from
  (when the checkpoint has no head, or its config.json ties it)."""
  reads = []
  shapes = {path: target.shape for path, target in flat.items()}
  for tensor in fmt.tensors:
    if tensor.path not in flat:
      continue  # A tensor this model does not have (biases, q/k norms).
    target = flat[tensor.path]
    name, layout = tensor.name, tensor.layout
    if tensor.tied_to and (tie or not files.has(name)):
      name, layout = tensor.tied_to, 'linear'
    lead = tuple(target.shape[:target.ndim - LAYER_NDIM[layout]]) if '{i}' in name else ()
    reads.append(_Read(tensor.path, name, layout, lead, tuple(target.shape[len(lead):]),
                       first_layer(tensor.path, shapes) if lead else 0))
  return reads


def _e_g(names: list[str], what: str, plural: str) -> str:
  """'tensor X is missing' or '3 tensors are missing, e.g. X'."""
  if len(names) == 1:
    return f'tensor {names[0]!r} {what}'
  return f'{len(names)} tensors {plural}, e.g. {names[0]!r}'


def _check_tensors(fmt: HFFormat, hf_config: dict, files: _Files, reads: list[_Read]) -> None:
  """One ConfigError line for the first kind of disagreement between the model and the files:
  tensors missing (any layer), tensors no parameter reads, shapes, dtypes."""
  expected = {}
  for read in reads:
    shape = _hf_shape(read.layout, read.inner)
    expected.update((name, shape) for name in read.names())
  stored = files.names()
  ignored = {n for n in stored if n.endswith(NOT_WEIGHTS)}
  ignored |= {t.name for t in fmt.tensors if t.tied_to and t.name in stored and
              t.name not in expected and t.tied_to in expected}  # config.json ties the head.
  _check_names(fmt, hf_config, files, reads, expected, ignored)
  _check_shapes(files, expected)
  _check_dtypes(files, expected)
  if ignored:
    logging.info('Not reading %d tensors of %s (buffers, or a head config.json ties to the '
                 'embedding): %s', len(ignored), files.path, sorted(ignored, key=_natural)[:3])


def _check_names(fmt: HFFormat, hf_config: dict, files: _Files, reads: list[_Read],
                 expected: dict, ignored: set[str]) -> None:
  """ConfigError if a tensor the model reads is not in the files, or the files hold one no
  parameter reads (not `ignored`); the layers config.json names and the files hold, when they
  differ."""
  where = files.where_text
  stored = files.names()
  missing = [n for n in expected if n not in stored]
  extra = sorted(stored - set(expected) - ignored, key=_natural)
  # The layers: how many the model has (config.json), which the files hold.
  layers = max((r.first + math.prod(r.lead[:-1] if '{e}' in r.name else r.lead)
                for r in reads if r.lead), default=0)
  patterns = [re.compile(re.escape(t.name).replace(re.escape('{i}'), r'(\d+)').replace(
      re.escape('{e}'), r'\d+') + '$') for t in fmt.tensors if '{i}' in t.name]
  layer_of = {n: int(m.group(1)) for n in stored for p in patterns for m in [p.match(n)] if m}
  held = sorted(set(layer_of.values()))
  extra.sort(key=lambda n: layer_of.get(n, -1) < layers)  # Layers past the model's first.
  says = (f'config.json says num_hidden_layers={hf_config["num_hidden_layers"]}'
          if 'num_hidden_layers' in hf_config else f'the model has {layers} layers')
  span = (f'the files hold layers {held[0]}..{held[-1]}' if held and held == list(
      range(held[0], held[-1] + 1)) else f'the files hold {len(held)} layers')
  if missing and extra:
    raise ConfigError(
        f'{where}: {_e_g(missing, "is missing", "are missing")}, and '
        f'{_e_g(extra, "is there, read by no parameter", "no parameter reads are there")}; '
        f'the files do not name their tensors as {fmt.architecture} checkpoints do, or '
        'config.json describes another model than the weights.')
  if missing:
    layer_note = f' ({says}; {span})' if held and held[-1] + 1 != layers else ''
    raise ConfigError(f'{where}: {_e_g(missing, "is missing", "are missing")}{layer_note}; the '
                      'checkpoint is incomplete or its config.json names more layers than it '
                      'holds.')
  if extra:
    beyond = held and held[-1] >= layers
    note = f' ({says}; {span})' if beyond else ''
    fix = ('config.json names fewer layers than the checkpoint holds; give it the right '
           'num_hidden_layers' if beyond else
           'the weights hold parameters config.json does not describe (biases, norms: another '
           'architecture or variant); use the config.json the weights came with')
    what = (f'tensor {extra[0]!r} is not read by any parameter of the model' if len(extra) == 1
            else f'{len(extra)} tensors no parameter of the model reads, e.g. {extra[0]!r}')
    raise ConfigError(f'{where}: {what}{note}: {fix}.')


def _check_shapes(files: _Files, expected: dict) -> None:
  """ConfigError naming the first tensor whose shape is not the one the model needs."""
  wrong = [(n, files.shape(n), shape) for n, shape in expected.items()
           if files.shape(n) != shape]
  if wrong:
    name, got, want = wrong[0]
    what = (f'{name!r} is {got}' if len(wrong) == 1 else
            f'{len(wrong)} tensors have other shapes than the model\'s, e.g. {name!r} is {got}')
    raise ConfigError(f'{files.where_text}: {what}, the model needs {want}; the config.json and '
                      'the weights disagree.')


def _check_dtypes(files: _Files, expected: dict) -> None:
  """ConfigError if a tensor the model reads is not floating point (a quantized checkpoint)."""
  odd = [(n, files.dtype(n)) for n in expected if files.dtype(n) not in FLOAT_DTYPES]
  if odd:
    what = _e_g([n for n, _ in odd], f'is {odd[0][1]}', 'are not floating point')
    if len(odd) > 1:
      what += f' ({odd[0][1]})'
    raise ConfigError(f'{files.where_text}: {what}; the engine reads floating-point weights '
                      f'({", ".join(FLOAT_DTYPES)}): load the unquantized checkpoint.')


def _natural(name: str):
  """Sorts 'layers.10' after 'layers.9'."""
  return [int(part) if part.isdigit() else part for part in re.split(r'(\d+)', name)]


def _open_checked(path: str, abstract_params) -> tuple[HFFormat, _Files, dict, list[_Read]]:
  """The checkpoint's files, opened (headers only), with every tensor's presence, shape and
  dtype checked, and that they hold nothing the model does not read: one ConfigError for a
  disagreement."""
  hf_config = read_config(path)
  fmt = format_of(hf_config, f'train.init_from=hf:{path}')
  files = _Files(path)
  flat = by_path(abstract_params)
  unknown = set(flat) - {t.path for t in fmt.tensors}
  if unknown:
    raise ConfigError(f'train.init_from=hf:{path}: the model has parameters no '
                      f'{fmt.architecture} tensor maps to: {sorted(unknown)}.')
  reads = _reads(fmt, files, flat, bool(hf_config.get('tie_word_embeddings')))
  _check_tensors(fmt, hf_config, files, reads)
  return fmt, files, flat, reads


def check(path: str, abstract_params) -> None:
  """What load_params checks, reading headers only: engine.assemble calls it before a run
  writes anything."""
  _open_checked(path, abstract_params)


def load_params(path: str, abstract_params):
  """The checkpoint's parameters, each created in the sharding `abstract_params` carries, once
  every tensor is checked (_open_checked)."""
  fmt, files, flat, reads = _open_checked(path, abstract_params)
  loaded = {}
  for read in reads:
    target = flat[read.path]

    def block(index, read=read, dtype=target.dtype):
      name, layout, lead, inner = read.name, read.layout, read.lead, read.inner
      if not lead:
        return _read_block(files, name, layout, index, inner).astype(dtype)
      # The stacked dimensions ([L], or [R, L / R] grouped; then [E]): one tensor each.
      ranges = [range(*s.indices(n)) for s, n in zip(index[:len(lead)], lead)]
      layers = [_read_block(files, tensor_name(name, lead, at, read.first), layout,
                            index[len(lead):], inner)
                for at in itertools.product(*ranges)]
      return np.stack(layers).reshape(*map(len, ranges), *layers[0].shape).astype(dtype)

    loaded[read.path] = jax.make_array_from_callback(target.shape, target.sharding, block)
  tied = any(t.tied_to and r.path == t.path and r.name == t.tied_to
             for t in fmt.tensors for r in reads)
  logging.info('Loaded %d tensors from %s%s', len(loaded), path,
               ' (output head tied to the embedding)' if tied else '')
  return jax.tree_util.tree_map_with_path(lambda keys, _: loaded[_path(keys)], abstract_params)


def _hf_shape(layout: str, inner: tuple[int, ...]) -> tuple[int, ...]:
  if layout in ('same', 'plus_one'):
    return inner
  if layout == 'linear':
    return inner[::-1]
  if layout == 'heads_out':
    return (inner[1] * inner[2], inner[0])
  if layout == 'heads_bias':
    return (inner[0] * inner[1],)
  return (inner[2], inner[0] * inner[1])

