"""Hugging Face checkpoints out: `engine.export` writes a run's parameters in its model family's
Hugging Face layout (config.json, generation_config.json, model.safetensors in the chosen dtype)
and its tokenizer as `AutoTokenizer` loads it. engine/hf/load.py reads them; the family's HFFormat
(engine/models/formats/interface.py) names the tensors.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
from absl import logging
from safetensors.numpy import save_file

from engine import models
from engine.errors import ConfigError
from engine.models.formats.interface import LAYER_NDIM, first_layer, tensor_name


def to_hf(layout: str, array: np.ndarray) -> np.ndarray:
  """One layer's engine array in the Hugging Face layout (the inverse of _read_block)."""
  if layout == 'same':
    return array
  if layout == 'plus_one':
    return np.asarray(array, np.float32) - 1
  if layout == 'linear':
    return array.T
  if layout == 'heads_out':  # [D, H, K] -> [H K, D]
    return array.reshape(array.shape[0], -1).T
  if layout == 'heads_bias':  # [H, K] -> [H K]
    return array.reshape(-1)
  return array.reshape(-1, array.shape[-1]).T  # [H, K, D] -> [D, H K]


# --dtype of engine.export: the safetensors dtype written (numpy has no bfloat16: ml_dtypes').
DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16, 'float16': np.float16}


def save(params: dict[str, np.ndarray], model_config, vocab_size: int, out: str,
         dtype: str = 'float32', token_ids: dict[str, int | None] | None = None) -> list[str]:
  """Writes `config.json` and `model.safetensors` of the model family's Hugging Face format
  (params: engine '/'-paths -> host arrays; stacked parameters [L, ...], or grouped
  [R, L / R, ...], then [E, ...] for experts), its tensors in `dtype` (a key of DTYPES).
  `token_ids` ({'bos_token_id', 'eos_token_id'}: the tokenizer's, None where it has none) go
  into config.json and generation_config.json: a null overrides the architecture's default ids
  (Llama's 1 and 2), which are other tokens of another vocabulary. Returns the tensor names
  written."""
  fmt = models.hf_format_for(model_config)
  shapes = {path: np.shape(array) for path, array in params.items()}
  tensors = {}
  for tensor in fmt.tensors:
    if tensor.path not in params:
      continue  # A tensor this model does not have (biases, q/k norms).
    array = np.asarray(params[tensor.path])
    if '{i}' not in tensor.name:
      tensors[tensor.name] = to_hf(tensor.layout, array)
      continue
    lead = array.shape[:array.ndim - LAYER_NDIM[tensor.layout]]  # Layers (then experts).
    for at in np.ndindex(*lead):
      name = tensor_name(tensor.name, lead, at, first_layer(tensor.path, shapes))
      tensors[name] = np.ascontiguousarray(
          to_hf(tensor.layout, array[at]))
  tensors = {name: _cast(name, value, dtype) for name, value in tensors.items()}
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, 'model.safetensors'), metadata={'format': 'pt'})
  write_config(model_config, vocab_size, out, dtype, token_ids)
  logging.info('Wrote %d tensors (%.1f MB, %s) to %s', len(tensors),
               sum(v.nbytes for v in tensors.values()) / 1e6, dtype, out)
  return sorted(tensors)


def write_config(model_config, vocab_size: int, out: str, dtype: str = 'float32',
                 token_ids: dict[str, int | None] | None = None) -> None:
  """config.json of the model family's Hugging Face format (its `model_type` is what
  AutoTokenizer reads too) and, with `token_ids`, generation_config.json (see `save`)."""
  config = models.hf_format_for(model_config).to_hf_config(model_config, vocab_size)
  # transformers 5 reads `dtype`; earlier versions `torch_dtype`.
  config.update(dtype=dtype, torch_dtype=dtype, **(token_ids or {}))
  os.makedirs(out, exist_ok=True)
  _write_json(os.path.join(out, 'config.json'), config)
  if token_ids is not None:
    _write_json(os.path.join(out, 'generation_config.json'), dict(token_ids))


def _cast(name: str, value: np.ndarray, dtype: str) -> np.ndarray:
  """`value` in `dtype`; a ConfigError if a finite value overflows it (float16's 65504)."""
  if dtype not in DTYPES:
    raise ConfigError(f'--dtype={dtype}: choose one of {", ".join(DTYPES)}.')
  with np.errstate(over='ignore'):
    cast = np.ascontiguousarray(value.astype(DTYPES[dtype]))
  if not np.isfinite(cast).all() and np.isfinite(value).all():
    raise ConfigError(f'--dtype={dtype}: {name!r} holds values up to {np.abs(value).max():g}, '
                      f'beyond {dtype}\'s range; export --dtype=bfloat16 or float32.')
  return cast


def _write_json(path: str, content: dict) -> None:
  with open(path, 'w') as f:
    json.dump(content, f, indent=2)
    f.write('\n')


# The tokenizer classes AutoTokenizer loads (transformers >= 5), by data.tokenizer: each takes the
# file as written. transformers' own class for a model type would rebuild it: Qwen2Tokenizer
# (model types qwen2, qwen3, qwen3_moe) splits the text with Qwen's pattern, LlamaTokenizer turns
# a SentencePiece model into a byte-fallback BPE without its normaliser.
TOKENIZER_CLASSES = {'hf': 'PreTrainedTokenizerFast', 'sentencepiece': 'SentencePieceBackend'}
# Where trust_remote_code=True loads the same classes from (auto_map, below).
EXPORTED_CLASSES_FILE = 'tokenization_exported.py'
_EXPORTED_CLASSES = {
    'hf': ('ExportedTokenizer', 'tokenizer.json as written, its normaliser and pre-tokenizer '
           'included.'),
    'sentencepiece': ('ExportedSentencePieceTokenizer', 'tokenizer.model through the '
                      'sentencepiece library, its normaliser included.')}


def _exported_classes_source(kind: str) -> str:
  name, what = _EXPORTED_CLASSES[kind]
  return (f'"""The tokenizer of this engine.export directory for AutoTokenizer with '
          f'trust_remote_code=True:\n{what}"""\n\n'
          f'from transformers import {TOKENIZER_CLASSES[kind]}\n\n\n'
          f'class {name}({TOKENIZER_CLASSES[kind]}):\n  """{what}"""\n')


def tokenizer_config(kind: str, tokens: dict[str, str | None], max_len: int) -> dict:
  """tokenizer_config.json of a data.tokenizer=`kind` export; `tokens`: the bos_token,
  eos_token (and unk_token) strings, None where the tokenizer has none.

  transformers >= 5 picks the class by the config's model_type before tokenizer_config's, and
  for some model types (qwen2) never takes the latter's; an `auto_map` entry turns both choices
  off. Without trust_remote_code it runs nothing (`tokenizer_class` is the class that loads);
  with it, EXPORTED_CLASSES_FILE's subclass of the same class loads. The beginning-of-text id
  comes first, as engine.data.prepare, engine.generate and engine.evaluate put it: for
  sentencepiece by add_bos_token (transformers ignores it beside a tokenizer.json, whose own
  post-processor adds it: `_add_bos`)."""
  config = {'tokenizer_class': TOKENIZER_CLASSES[kind],
            'auto_map': {'AutoTokenizer': [
                None, f'{EXPORTED_CLASSES_FILE[:-3]}.{_EXPORTED_CLASSES[kind][0]}']}}
  if kind == 'sentencepiece':
    config.update(add_bos_token=tokens['bos_token'] is not None, add_eos_token=False)
    if tokens['bos_token'] is not None:
      config['special_tokens_pattern'] = 'bos'  # How SentencePieceBackend adds it.
  return {**config, **tokens, 'model_max_length': max_len}


def _add_bos(tokenizer, bos: str | None) -> bool:
  """Gives the `tokenizers` Tokenizer a post-processor that puts `bos` first, if it has one and
  no post-processor of its own: what transformers adds by default (the engine encodes without
  it, then adds the id itself). Whether it did."""
  from tokenizers import processors  # pylint: disable=g-import-not-at-top
  if bos is None or tokenizer.post_processor is not None:
    return False
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f'{bos} $A', pair=f'{bos} $A {bos} $B',
      special_tokens=[(bos, tokenizer.token_to_id(bos))])
  return True


def save_tokenizer(tokenizer, out: str, max_len: int) -> str:
  """Writes the run's tokenizer as Hugging Face's `AutoTokenizer` loads it, into `out`; returns
  a line saying what it wrote (nothing for byte and character vocabularies, which have no Hugging
  Face tokenizer file).

    hf             tokenizer.json, loaded whole by PreTrainedTokenizerFast (the run's, with a
                   post-processor that adds the beginning-of-text id where it has none);
    sentencepiece  tokenizer.model (copied), run by the sentencepiece library itself
                   (SentencePieceBackend; reading it needs the sentencepiece and protobuf
                   packages);

  each with tokenizer_config.json (`tokenizer_config`) and EXPORTED_CLASSES_FILE. python -m
  engine.analysis.tokenizer_check checks that transformers gives the engine's ids.
  """
  kind = tokenizer.kind
  if kind not in ('hf', 'sentencepiece'):
    what = ('UTF-8 bytes' if kind == 'byte' else "the training text's characters, sorted")
    return (f'no tokenizer files: data.tokenizer={kind} (ids are {what}) has no Hugging Face '
            'tokenizer file.')
  ids = {'bos_token': tokenizer.bos_id, 'eos_token': tokenizer.eos_id}
  if kind == 'hf':
    import tokenizers  # pylint: disable=g-import-not-at-top
    backend = tokenizers.Tokenizer.from_file(tokenizer.path)
    name, piece = 'tokenizer.json', backend.id_to_token
  else:
    import sentencepiece  # pylint: disable=g-import-not-at-top
    processor = sentencepiece.SentencePieceProcessor(model_file=tokenizer.path)
    name, piece = 'tokenizer.model', processor.id_to_piece
    if processor.unk_id() >= 0:
      ids['unk_token'] = processor.unk_id()
  tokens = {key: None if i is None else piece(i) for key, i in ids.items()}
  config = tokenizer_config(kind, tokens, max_len)
  if kind == 'hf' and _add_bos(backend, tokens['bos_token']):
    backend.save(os.path.join(out, name))
  else:
    shutil.copyfile(tokenizer.path, os.path.join(out, name))
  _write_json(os.path.join(out, 'tokenizer_config.json'), config)
  with open(os.path.join(out, EXPORTED_CLASSES_FILE), 'w') as f:
    f.write(_exported_classes_source(kind))
  return (f'{name}, tokenizer_config.json ({config["tokenizer_class"]}) and '
          f'{EXPORTED_CLASSES_FILE} from {tokenizer.path}.')
