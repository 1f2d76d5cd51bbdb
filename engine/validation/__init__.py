"""The one validation pass over a config, before anything compiles or is written.

`validate` checks the whole tree (engine/config.py's schema), one function per section (model,
data, optim (engine/validation/optim.py), train, mesh, parallelism; then the train step's
schedule and the model sizes the mesh splits), and raises `ConfigError` naming the key and the
fix; engine.assemble calls it for every command before anything touches a device.
`check_layout` checks the laid-out model once its shapes are known.

  attention.py  the attention kernel's keys (splash's block sizes and lengths)
  moe.py        a mixture of experts' keys against the mesh
  optim.py      the optimizer and its schedule
  samples.py    the training loop's text samples
"""

from __future__ import annotations

import math
import os

import ml_collections
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from engine import models, parallel, sharding
from engine.cli import config_help
from engine.data import text_files
from engine.config import (DTYPES, FSDP_GATHERS, SOURCES, TOKENIZERS, parse_profile_steps,
                           resolve_mesh_shape)
from engine.errors import ConfigError
from engine.models import attention as model_attention
from engine.models import llama
from engine.validation.attention import check_splash
from engine.validation.moe import check_moe
from engine.validation.optim import check_optim
from engine.validation.samples import check_sample_keys


_MAX_SEED = 2**32 - 2


def _check_data_file(path: str) -> None:
  """data.path must name a readable file (its UTF-8 and length are checked when it is read)."""
  fix = ('pass --config.data.path=PATH to a UTF-8 text file, or use '
         '--config.data.source=embedded.')
  if not path:
    raise ConfigError(f"data.path='' is not set, but data.source='file' reads it; {fix}")
  text_files.check_file(path, f'data.path={path!r}', fix)


def _check_init_from(workdir: str) -> None:
  """train.init_from must be the workdir of a run that saved a complete checkpoint: Orbax names
  finished checkpoints by their step and unfinished ones with a temporary suffix."""
  if '://' in workdir:
    return  # A bucket: checked when the parameters are restored.
  if workdir.startswith('hf:'):  # A Hugging Face checkpoint (engine/hf/load.py).
    if not os.path.isfile(os.path.join(workdir[3:], 'config.json')):
      raise ConfigError(f'train.init_from={workdir!r}: no config.json in {workdir[3:]!r}; pass '
                        'hf:DIR with a Hugging Face checkpoint (config.json and *.safetensors).')
    return
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    raise ConfigError(
        f'train.init_from={workdir!r} has no checkpoints/ directory; pass the --workdir of a run '
        'that saved a checkpoint.')
  if not any(name.isdigit() for name in os.listdir(directory)):
    raise ConfigError(
        f'train.init_from={workdir!r} holds no complete checkpoint; pass the --workdir of a run '
        'that saved one.')


def _require_positive(section: ConfigDict, prefix: str, names: list[str]) -> None:
  for name in names:
    if section[name] <= 0:
      raise ConfigError(f'{prefix}.{name}={section[name]} must be positive.')


def _require_divisible(value: int, value_key: str, by: int, by_name: str) -> None:
  if value % by:
    raise ConfigError(
        f'{value_key}={value} is not divisible by {by_name}={by}; change one of them so that '
        f'{by_name} divides {value_key}.')


def count_slices(devices) -> int:
  """How many TPU slices the devices form (1 off multi-slice TPU pods)."""
  return len({getattr(d, 'slice_index', 0) for d in devices})


def _choose(section: ConfigDict, name: str, key: str, choices) -> None:
  if section[name] not in choices:
    raise ConfigError(f'{key}={section[name]!r} is unknown; choose one of {choices}.')


def _require_finite(section: ConfigDict, prefix: str, names: list[str]) -> None:
  for name in names:
    if not math.isfinite(section[name]):
      raise ConfigError(f'{prefix}.{name}={section[name]} is not a finite number; give one.')


def _require_non_negative(section: ConfigDict, prefix: str, names: list[str]) -> None:
  for name in names:
    if section[name] < 0:
      raise ConfigError(f'{prefix}.{name}={section[name]} must be >= 0.')


def validate(config: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1,
             num_slices: int = 1, training: bool = True,
             reads_text: bool = True) -> ml_collections.ConfigDict:
  """Checks the whole config, section by section; returns it unchanged or raises ConfigError
  naming key and fix. `num_slices` > 1 (several TPU slices): the dcn axes split the mesh by
  slice, not by process. `training=False` (a finished run laid out for generation or export)
  skips what only a train step needs: the batch's split and the pipeline schedule;
  `reads_text=False` (a command that needs only the vocabulary, such as engine.plan) does not
  ask for data.path's file."""
  config_help.check_known_keys(config)
  if config.model.name not in models.MODELS:
    raise ConfigError(f'model.name={config.model.name!r} is unknown; choose one of '
                      f'{sorted(models.MODELS)}.')
  parallel.check_modes(config.parallelism.mode)
  _check_model(config.model)
  _check_data(config.data, config.model, reads_text or config.data.tokenizer == 'char')
  check_optim(config.optim)
  _check_train(config.train)
  check_sample_keys(config.train, num_processes if training else 1)  # Samples only in training.
  if not 0 <= config.seed <= _MAX_SEED:
    raise ConfigError(f'seed={config.seed} must lie in [0, {_MAX_SEED}]: the data order is '
                      'shuffled with 32-bit seeds (evaluation uses seed + 1); give e.g. '
                      '--config.seed=0.')
  mesh = _check_mesh(config.mesh, num_devices, num_processes, num_slices)
  check_splash(config, mesh)  # Before the context checks: their fix would not apply.
  rules = _check_parallelism(config, mesh)
  check_moe(config, mesh)
  if training:
    _check_schedule(config, mesh, rules, num_processes)
  _check_model_splits(config.model, mesh)
  return config


def _check_model(model: ConfigDict) -> None:
  _choose(model, 'dtype', 'model.dtype', DTYPES)
  _choose(model, 'attention', 'model.attention', model_attention.IMPLEMENTATIONS)
  _choose(model, 'attention_scale_on', 'model.attention_scale_on', model_attention.SCALE_ON)
  _choose(model, 'remat', 'model.remat', tuple(parallel.steps.REMAT_POLICIES))
  _require_finite(model, 'model', ['init_std', 'norm_eps', 'rope_base'])
  _require_positive(model, 'model', ['num_layers', 'num_heads', 'embed_dim', 'mlp_dim', 'max_len',
                                     'vocab_multiple', 'norm_eps', 'rope_base'])
  if model.vocab_size != -1 and model.vocab_size <= 0:
    raise ConfigError(f'model.vocab_size={model.vocab_size} must be positive, or -1 to '
                      'take it from the tokenizer.')
  _require_non_negative(model, 'model', ['init_std'])
  if model.attention_scale != -1 and not (math.isfinite(model.attention_scale) and
                                          model.attention_scale > 0):
    raise ConfigError(f'model.attention_scale={model.attention_scale} must be a positive number, '
                      'or -1 for 1/sqrt(head_dim).')
  _check_llama_keys(model)
  if model.head_dim == -1:
    _require_divisible(model.embed_dim, 'model.embed_dim', model.num_heads, 'model.num_heads')
  elif model.head_dim <= 0:
    raise ConfigError(f'model.head_dim={model.head_dim} must be positive, or -1 for '
                      'model.embed_dim / model.num_heads.')
  kv_heads = model.num_kv_heads
  if kv_heads != -1 and (kv_heads <= 0 or model.num_heads % kv_heads):
    raise ConfigError(
        f'model.num_kv_heads={kv_heads} must divide model.num_heads={model.num_heads} '
        '(each key/value head serves a group of query heads), or be -1 for one per query head.')
  head_dim = model.head_dim if model.head_dim > 0 else model.embed_dim // model.num_heads
  if model.name == 'llama' and head_dim % 2:
    what = ('model.head_dim' if model.head_dim > 0 else 'model.embed_dim / model.num_heads')
    raise ConfigError(
        f'{what} = {head_dim} is odd; rotary embeddings rotate pairs of dimensions, so choose '
        'an even head size.')


# Keys that only the Llama family reads, with their neutral values: another model refuses them.
_LLAMA_ONLY = {'head_dim': -1, 'qkv_bias': False, 'qk_norm': False, 'rope_type': 'default',
               'sliding_window': 0, 'hf_architecture': '', 'num_experts': 0}


def _check_llama_keys(model: ConfigDict) -> None:
  """The rotary settings, and no Llama-only key set on a model that would ignore it."""
  if model.name != 'llama':
    changed = [k for k, neutral in _LLAMA_ONLY.items() if model[k] != neutral]
    if changed:
      raise ConfigError(f'model.{changed[0]}={model[changed[0]]!r} is read by the llama model '
                        f'only; model.name={model.name!r} would ignore it: drop it.')
    return
  _choose(model, 'rope_type', 'model.rope_type', llama.ROPE_TYPES)
  if model.rope_type != 'default':
    _require_positive(model, 'model', ['rope_factor'])
  if model.rope_type == 'llama3':
    _require_positive(model, 'model', ['rope_low_freq_factor', 'rope_original_max_len'])
    if not model.rope_high_freq_factor > model.rope_low_freq_factor:
      raise ConfigError(f'model.rope_high_freq_factor={model.rope_high_freq_factor} must exceed '
                        f'model.rope_low_freq_factor={model.rope_low_freq_factor} (llama3 '
                        'interpolates between the two wavelengths).')
  if model.sliding_window < 0:
    raise ConfigError(f'model.sliding_window={model.sliding_window} must be >= 0 (0: none).')


def _check_data(data: ConfigDict, model: ConfigDict, reads_text: bool = True) -> None:
  _choose(data, 'source', 'data.source', SOURCES)
  _choose(data, 'tokenizer', 'data.tokenizer', TOKENIZERS)
  if data.source == 'file' and reads_text:
    _check_data_file(data.path)
  subword = data.tokenizer in ('hf', 'sentencepiece')
  if subword and data.source != 'shards' and not os.path.isfile(data.tokenizer_path):
    raise ConfigError(
        f'data.tokenizer={data.tokenizer!r} reads data.tokenizer_path, but '
        f'{data.tokenizer_path!r} is not a file; pass --config.data.tokenizer_path=PATH '
        '(python -m engine.data.train_tokenizer makes a tokenizer.json from any text).')
  if data.source == 'shards' and not data.shards:
    raise ConfigError("data.source='shards' reads data.shards, which is empty; pass "
                      '--config.data.shards=DIR (an engine.data.prepare output; DIR:WEIGHT,... to '
                      'mix).')
  if data.path and data.source != 'file':
    raise ConfigError(
        f'data.path={data.path!r} is set but data.source={data.source!r} does not '
        'read files; add --config.data.source=file, or drop data.path.')
  _require_positive(data, 'data', ['seq_len', 'global_batch_size', 'embedded_max_bytes',
                                   'synthetic_tokens'])
  if not 0.0 < data.val_fraction < 1.0:
    raise ConfigError(f'data.val_fraction={data.val_fraction} must lie in (0, 1).')
  if 0 < model.sliding_window < data.seq_len:
    raise ConfigError(
        f'model.sliding_window={model.sliding_window} is shorter than data.seq_len='
        f'{data.seq_len}: the engine computes full causal attention, which differs from a '
        f'sliding window once a sequence is longer than it; use data.seq_len <= '
        f'{model.sliding_window}.')
  if data.seq_len > model.max_len:
    fix = ('raise model.max_len or shorten data.seq_len' if not model.hf_architecture else
           "shorten data.seq_len (model.max_len is the checkpoint's max_position_embeddings)")
    raise ConfigError(
        f'data.seq_len={data.seq_len} exceeds model.max_len={model.max_len}; {fix}.')


def _check_train(train: ConfigDict) -> None:
  if train.skip_nonfinite_steps < 0:
    raise ConfigError(f'train.skip_nonfinite_steps={train.skip_nonfinite_steps} must be '
                      '>= 0: 0 stops at the first step that is not finite, N > 0 skips up to N '
                      'in a row.')
  _require_positive(train, 'train', ['num_steps', 'log_every', 'eval_every', 'eval_batches',
                                     'checkpoint_every', 'keep_checkpoints', 'microbatches',
                                     'pipeline_repeats'])
  if train.init_from:
    _check_init_from(train.init_from)
  parse_profile_steps(train.profile_steps, train.num_steps)


def _check_mesh(mesh_config: ConfigDict, num_devices: int, num_processes: int,
                num_slices: int) -> dict[str, int]:
  """The mesh's sizes over the devices, and its split across hosts or slices."""
  mesh = resolve_mesh_shape(mesh_config, num_devices)
  for axis in ('data', 'fsdp'):
    dcn = mesh_config[f'dcn_{axis}']
    if dcn < 1 or mesh[axis] % dcn:
      raise ConfigError(f'mesh.dcn_{axis}={dcn} must be >= 1 and divide mesh.{axis}={mesh[axis]} '
                        f'(the {axis} axis is split into dcn_{axis} groups across hosts).')
  hosts = mesh_config.dcn_data * mesh_config.dcn_fsdp
  if num_slices > 1 and hosts != num_slices:
    raise ConfigError(
        f'mesh.dcn_data*mesh.dcn_fsdp={hosts} must equal the number of TPU slices '
        f'({num_slices}): the data-centre network joins the slices along those axes; set '
        f'mesh.dcn_data={num_slices} (or split it with mesh.dcn_fsdp).')
  if hosts > 1 and num_slices == 1 and hosts != num_processes:
    raise ConfigError(
        f'mesh.dcn_data*mesh.dcn_fsdp={hosts} must equal the number of processes '
        f'({num_processes}), one group of devices per host; set them to 1 to let the mesh follow '
        'the device order.')
  return mesh


def _check_parallelism(config: ConfigDict, mesh: dict[str, int]) -> sharding.Rules:
  """The rules, and what the mode, context and stage axes ask of the model."""
  parallelism = config.parallelism
  _choose(parallelism, 'grad_reduce_dtype', 'parallelism.grad_reduce_dtype', DTYPES)
  _choose(parallelism, 'fsdp_gather', 'parallelism.fsdp_gather', FSDP_GATHERS)
  if parallelism.rules not in sharding.RULE_PRESETS and parallelism.rules != 'auto':
    raise ConfigError(f'parallelism.rules={parallelism.rules!r} is unknown; choose '
                      f"'auto' or one of {sorted(sharding.RULE_PRESETS)}.")
  rules = sharding.rules_for(parallelism.rules, mesh)
  unused = [a for a, size in mesh.items() if size > 1 and a not in rules.mesh_axes_used()]
  if unused:
    raise ConfigError(
        f'parallelism.rules={parallelism.rules!r} does not use mesh axes {unused} of size '
        '> 1, so they would only duplicate work; set them to 1 or pick rules that use them.')
  named = sharding.RULE_PRESETS.get(parallelism.rules, rules).params
  # Stages and experts are optional splits of any preset (experts exist only in a MoE model).
  splits = {a for axes in named.values() for a in axes if a not in ('stage', 'expert')}
  if splits and math.prod(mesh.values()) > 1 and not any(mesh[a] > 1 for a in splits):
    raise ConfigError(
        f'parallelism.rules={parallelism.rules!r} splits parameters over mesh '
        f'{" and ".join(sorted(splits))}, which {"is" if len(splits) == 1 else "are"} 1: every '
        f'device would hold them whole; give mesh.{" or mesh.".join(sorted(splits))} a size '
        "> 1, or set parallelism.rules='data_parallel'.")
  context = mesh['context']
  if context > 1 and config.data.seq_len % (2 * context):
    raise ConfigError(
        f'data.seq_len={config.data.seq_len} must be a multiple of 2*mesh.context={2 * context}: '
        'each device holds two of the 2*context chunks of every sequence (one early, one late, '
        'so that causal attention costs every device the same).')
  if (context > 1 and parallelism.mode == 'manual'
      and config.model.attention not in ('einsum', 'splash')):
    raise ConfigError(
        f'model.attention={config.model.attention!r} with mesh.context={context} in manual mode: '
        "ring attention computes its own blocks; set model.attention='einsum' or 'splash' (auto "
        'mode may keep it).')
  stages = mesh['stage']
  if stages > 1 and config.model.num_layers % stages:
    raise ConfigError(
        f'model.num_layers={config.model.num_layers} does not split into mesh.stage={stages} '
        'pipeline stages of equal depth; choose a stage count that divides it.')
  return rules


def _check_schedule(config: ConfigDict, mesh: dict[str, int], rules: sharding.Rules,
                    num_processes: int) -> None:
  """What a train step needs: the pipeline schedule, and the batch split over the batch axes,
  the processes and the micro-batches."""
  stages, repeats = mesh['stage'], config.train.pipeline_repeats
  if repeats > 1 and stages == 1:
    raise ConfigError(
        f'train.pipeline_repeats={repeats}: the circular pipeline schedule needs mesh.stage > 1; '
        'set it to 1, or split the mesh into stages.')
  if repeats > 1 and config.model.num_layers % (stages * repeats):
    raise ConfigError(
        f'model.num_layers={config.model.num_layers} does not split into mesh.stage={stages} x '
        f'train.pipeline_repeats={repeats} groups of equal depth; choose counts whose product '
        'divides it.')
  if stages > 1 and config.train.microbatches < stages:
    raise ConfigError(
        f'train.microbatches={config.train.microbatches} is fewer than mesh.stage={stages}: the '
        'pipeline would never fill; give at least as many micro-batches as stages (more shrink '
        f'the idle fraction, (stages - 1) / (microbatches + stages - 1)).')
  batch_axes = rules.mesh_axes('batch', activation=True)
  batch_ways = math.prod(mesh[a] for a in batch_axes)
  global_batch = config.data.global_batch_size
  if global_batch % batch_ways:
    raise ConfigError(
        f'data.global_batch_size={global_batch} does not split over the mesh\'s '
        f'batch axes {"*".join(batch_axes)}={batch_ways}; make it a multiple of {batch_ways}, or '
        'change the mesh.')
  _require_divisible(global_batch, 'data.global_batch_size', num_processes,
                     'the number of processes')
  local_batch = global_batch // batch_ways
  if local_batch % config.train.microbatches:
    raise ConfigError(
        f'train.microbatches={config.train.microbatches} does not divide the {local_batch} rows '
        f'each device holds (data.global_batch_size={global_batch} over '
        f'{batch_ways} batch shards); choose a divisor of {local_batch}, or a larger batch.')


def _check_model_splits(model: ConfigDict, mesh: dict[str, int]) -> None:
  """The model sizes the tensor and fsdp axes split (every parameter's split is checked once
  the model is laid out: check_layout)."""
  tensor = mesh['tensor']
  _require_divisible(model.num_heads, 'model.num_heads', tensor, 'mesh.tensor')
  _require_divisible(model.mlp_dim, 'model.mlp_dim', tensor, 'mesh.tensor')
  if model.vocab_size != -1:
    _require_divisible(model.vocab_size, 'model.vocab_size', tensor, 'mesh.tensor')
  else:
    _require_divisible(model.vocab_multiple, 'model.vocab_multiple', tensor, 'mesh.tensor')
  _require_divisible(model.embed_dim, 'model.embed_dim', mesh['fsdp'], 'mesh.fsdp')


def check_layout(train_setup) -> None:
  """The laid-out model (engine.state.TrainSetup), once its shapes are known: every split
  dimension of every parameter divides over its mesh axes, and a context axis meets a model
  that reads positions through `ops`. Any model's sizes are checked here, before anything
  compiles."""
  mesh_shape = dict(train_setup.mesh.shape)
  for p in train_setup.parameters():
    for dim, (size, name, entry) in enumerate(zip(p.shape, p.logical_axes, p.spec)):
      axes = sharding.spec_axes(P(entry))
      ways = math.prod(mesh_shape[a] for a in axes)
      if size % ways:
        raise ConfigError(
            f'Parameter {p.path} {p.shape}: dimension {dim} ({name!r}, size {size}) is split '
            f'{ways} ways over mesh axes {axes}, which does not divide it; choose model sizes '
            f'that the mesh divides, or rules (parallelism.rules) that do not split {name!r}.')
  model = train_setup.model
  if mesh_shape['context'] > 1 and not model.context_parallel:
    raise ConfigError(
        f'mesh.context={mesh_shape["context"]}: model {model.name!r} does not support context '
        'parallelism (its ModelSpec has context_parallel=False); set mesh.context=1.')
