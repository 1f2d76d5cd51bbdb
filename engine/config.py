"""The config schema, its defaults, and the one validation pass that runs before anything compiles.

Every experiment file starts from `default_config()` and overrides what it needs, so the schema
lives here once. `validate` checks the whole tree and raises `ConfigError` naming the key and the
fix; the train loop calls it before it touches a device.
"""

from __future__ import annotations

import math
import os
import re

import ml_collections
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from engine import models, parallel, sharding
from engine.models import attention

SOURCES = ('embedded', 'file', 'synthetic', 'shards')
TOKENIZERS = ('byte', 'char', 'hf', 'sentencepiece')
MESH_AXES = ('data', 'fsdp', 'tensor', 'context', 'stage')
DTYPES = ('float32', 'bfloat16')


class ConfigError(ValueError):
  """A config value that cannot work; the message names the key and the fix."""


def default_config() -> ml_collections.ConfigDict:
  """The full schema with its defaults: a tiny GPT on the embedded corpus, one device."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.name = 'gpt'
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.embed_dim = 64
  c.model.mlp_dim = 256
  c.model.max_len = 64  # Learned position embeddings cover this many positions.
  # -1: the tokenizer's vocabulary, rounded up to a multiple of `vocab_multiple` so that it
  # splits over any tensor axis that divides the multiple.
  c.model.vocab_size = -1
  c.model.vocab_multiple = 64
  c.model.tie_embeddings = True
  c.model.scan_layers = True  # False unrolls the layer loop in the HLO (debugging).
  c.model.init_std = 0.02
  c.model.norm_eps = 1e-5
  c.model.attention = 'einsum'  # einsum | dot_product_attention (jax.nn; cuDNN flash on GPUs)
  c.model.attention_scale_on = 'queries'  # Where 1/sqrt(head_dim) goes: queries | logits.
  c.model.num_kv_heads = -1  # Llama: key/value heads (grouped-query attention); -1: num_heads.
  c.model.rope_base = 10_000.0  # Llama: rotary position embedding base.
  # Compute dtype: float32 | bfloat16. Parameters and optimizer state stay float32; logits and
  # the loss are float32.
  c.model.dtype = 'float32'
  # What each layer keeps for the backward pass: none (keep all) | full (recompute the layer) |
  # dots_saveable | dots_with_no_batch_dims_saveable (keep matmul outputs).
  c.model.remat = 'none'

  c.data = ml_collections.ConfigDict()
  c.data.source = 'embedded'  # embedded | file | synthetic | shards
  c.data.path = ''  # Text file, for source='file'.
  # byte | char | hf (a tokenizer.json) | sentencepiece (a .model); shards use the tokenizer
  # they were written with (engine.prepare), whatever this says.
  c.data.tokenizer = 'byte'
  c.data.tokenizer_path = ''  # For tokenizer='hf' or 'sentencepiece'.
  # For source='shards': an engine.prepare output directory, or DIR:WEIGHT,DIR:WEIGHT to mix
  # several by weight.
  c.data.shards = ''
  c.data.seq_len = 64
  c.data.global_batch_size = 16
  c.data.val_fraction = 0.1
  c.data.embedded_max_bytes = 2_000_000  # How much of the embedded corpus to read.
  c.data.synthetic_tokens = 100_000

  c.optim = ml_collections.ConfigDict()
  c.optim.learning_rate = 1e-3
  c.optim.end_learning_rate = 1e-4
  c.optim.warmup_steps = 20
  c.optim.decay_steps = -1  # -1: warmup + cosine decay end at train.num_steps.
  c.optim.b1 = 0.9
  c.optim.b2 = 0.99
  c.optim.weight_decay = 0.1
  c.optim.weight_decay_on = 'matrices'  # matrices (not norms, biases) | all
  c.optim.grad_clip_norm = 1.0  # Global norm the gradients are scaled down to; inf: off.

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1: all devices the other axes leave.
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # Context (sequence) parallelism: each sequence split over this many devices; manual mode runs
  # ring attention over them (engine/parallel/context.py).
  c.mesh.context = 1
  # Pipeline parallelism: the stacked layers split into this many stages, fed train.microbatches
  # micro-batches on a GPipe schedule (engine/parallel/pipeline.py).
  c.mesh.stage = 1
  # How many hosts (or TPU slices) the data / fsdp axes span: those axes are laid out across the
  # slow inter-host network and everything else within a host. 1 = no preference.
  c.mesh.dcn_data = 1
  c.mesh.dcn_fsdp = 1

  c.parallelism = ml_collections.ConfigDict()
  c.parallelism.mode = 'auto'
  c.parallelism.rules = 'auto'  # A preset in engine.sharding.RULE_PRESETS; 'auto' follows the mesh.
  # Manual mode: dtype of the gradient reductions and of the FSDP gathers they transpose.
  c.parallelism.grad_reduce_dtype = 'float32'  # float32 | bfloat16

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 300
  c.train.log_every = 25
  c.train.eval_every = 100
  c.train.eval_batches = 8
  c.train.checkpoint_every = 100
  c.train.keep_checkpoints = 3
  # False: the loop waits for every save to reach the disk (to measure what async saves save).
  c.train.async_checkpoints = True
  # If the newest checkpoint is damaged (its files differ from their checksums), resume from the
  # newest intact one, moving the damaged ones to damaged_checkpoints/. False: stop and say so.
  c.train.skip_damaged_checkpoints = False
  # 0: a step whose loss or gradient norm is not finite stops the run. N > 0: such a step's
  # update is not applied and the run goes on, up to N such steps in a row.
  c.train.skip_nonfinite_steps = 0
  # Gradients over this many slices of each batch, accumulated, then applied once (with
  # mesh.stage > 1: the micro-batches that flow through the pipeline).
  c.train.microbatches = 1
  # Pipeline schedule (mesh.stage > 1): 1 = GPipe; R > 1 = circular, each stage holding R
  # groups of model.num_layers / (stage * R) layers, which shrinks the idle fraction to
  # (stage - 1) / (R * microbatches + stage - 1) for R times the activation transfers. The
  # stacked parameters are stored as [R, layers / R, ...]: a checkpoint resumes with the same R.
  c.train.pipeline_repeats = 1
  # Start from the parameters (not the optimizer state) of another run's latest checkpoint:
  # that run's --workdir. Used only when this workdir has no checkpoint yet.
  c.train.init_from = ''
  return c


_TRUE, _FALSE = ('', '1', 'true', 'yes'), ('0', 'false', 'no')


def parse_arg(arg: str | None, **defaults):
  """Parses big_vision-style 'k=v,flag' experiment arguments, typed by their defaults."""
  parsed = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, _, value = item.partition('=')
    if key not in defaults:
      raise ConfigError(f'Unknown experiment argument {key!r}; the experiment takes '
                        f'{", ".join(sorted(defaults))} (e.g. :steps=100,mesh=2x2x2).')
    kind = type(defaults[key])
    if kind is bool:
      if value.lower() not in _TRUE + _FALSE:
        raise ConfigError(f'experiment argument {key}={value} is not true or false; give '
                          f'{key}=true or {key}=false.')
      parsed[key] = value.lower() in _TRUE
      continue
    try:
      parsed[key] = kind(value)
    except ValueError:
      kind_name = {int: 'an integer', float: 'a number'}.get(kind, kind.__name__)
      raise ConfigError(f'experiment argument {key}={value} is not {kind_name}; give one, e.g. '
                        f'{key}={defaults[key]}.') from None
  return ml_collections.ConfigDict(parsed)


def parse_run_arg(arg: str | None, steps: int, **extra):
  """The experiment arguments every experiment takes: mode=, mesh=DxFxT, steps=N (+ extra)."""
  return parse_arg(arg, mode='auto', mesh='', steps=steps, **extra)


def apply_run_args(config: ml_collections.ConfigDict, args) -> ml_collections.ConfigDict:
  """Sets parallelism.mode, the mesh shape (if given) and train.num_steps from parse_run_arg."""
  config.parallelism.mode = args.mode
  if args.mesh:
    set_mesh_shape(config, args.mesh)
  config.train.num_steps = args.steps
  return config


def set_mesh_shape(config: ml_collections.ConfigDict, shape: str) -> None:
  """Applies a 'DxFxT', 'DxFxTxC' or 'DxFxTxCxS' mesh string (data x fsdp x tensor [x context
  [x stage]]) from an experiment argument."""
  sizes = shape.split('x')
  if len(sizes) not in (3, 4, 5) or not all(re.fullmatch(r'-?[0-9]+', size) for size in sizes):
    raise ConfigError(f'mesh={shape} is not DATAxFSDPxTENSOR[xCONTEXT[xSTAGE]], integers joined '
                      'by x; give e.g. mesh=2x2x2 or mesh=2x1x1x2x2 (-1: the devices the other '
                      'axes leave, e.g. mesh=-1x1x2).')
  for axis, size in zip(MESH_AXES, sizes):
    config.mesh[axis] = int(size)


def flat_defaults() -> dict[str, object]:
  """Every key of the schema as a dotted path ('model.num_layers') with its default; each
  section ('model') maps to its ConfigDict."""
  flat = {}

  def walk(section: ConfigDict, prefix: str) -> None:
    for key, value in section.items():
      flat[prefix + key] = value
      if isinstance(value, ConfigDict):
        walk(value, prefix + key + '.')

  walk(default_config(), '')
  return flat


def _unknown_keys(config: ConfigDict, schema: ConfigDict, prefix: str = '') -> list[str]:
  unknown = []
  for key, value in config.items():
    if key not in schema:
      unknown.append(prefix + key)
    elif isinstance(value, ConfigDict) and isinstance(schema[key], ConfigDict):
      unknown += _unknown_keys(value, schema[key], prefix + key + '.')
  return unknown


def resolve_mesh_shape(mesh_config, num_devices: int) -> dict[str, int]:
  """Mesh axis sizes with the single -1 filled in; raises if they cannot cover the devices."""
  # dcn_* are checked separately; an axis the config leaves out has size 1.
  sizes = {axis: int(mesh_config.get(axis, 1)) for axis in MESH_AXES}
  free = [axis for axis, size in sizes.items() if size == -1]
  for axis, size in sizes.items():
    if size == 0 or size < -1:
      raise ConfigError(f'mesh.{axis}={size}: axis sizes must be positive, or -1 for "the rest".')
  if len(free) > 1:
    raise ConfigError(f'mesh: only one axis may be -1, got {free}; give the others sizes.')
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % fixed:
      raise ConfigError(
          f'mesh: the fixed axes multiply to {fixed}, which does not divide the {num_devices} '
          f'devices, so mesh.{free[0]}=-1 has no size; choose sizes whose product divides '
          f'{num_devices}.')
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    shown = [a for a in MESH_AXES if a not in ('context', 'stage') or sizes[a] != 1]
    raise ConfigError(
        f'mesh: {"*".join(shown)} = {"*".join(str(sizes[a]) for a in shown)} = {fixed}, '
        f'but there are {num_devices} devices; make the product {num_devices} or set one axis '
        'to -1.')
  return sizes


_MAX_SEED = 2**32 - 2


def _check_data_file(path: str) -> None:
  """data.path must name a readable file (its UTF-8 and length are checked when it is read)."""
  fix = ('pass --config.data.path=PATH to a UTF-8 text file, or use '
         '--config.data.source=embedded.')
  if not path:
    raise ConfigError(f"data.path='' is not set, but data.source='file' reads it; {fix}")
  if os.path.isdir(path):
    raise ConfigError(f'data.path={path!r} is a directory, not a file; {fix}')
  if not os.path.isfile(path):
    raise ConfigError(f'data.path={path!r} does not exist; {fix}')
  if not os.access(path, os.R_OK):
    raise ConfigError(f'data.path={path!r} cannot be read (permissions); {fix}')


def _check_init_from(workdir: str) -> None:
  """train.init_from must be the workdir of a run that saved a complete checkpoint: Orbax names
  finished checkpoints by their step and unfinished ones with a temporary suffix."""
  if '://' in workdir:
    return  # A bucket: checked when the parameters are restored.
  if workdir.startswith('hf:'):  # A Hugging Face checkpoint (engine/hf.py).
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


def _require_positive(config, keys: list[str]) -> None:
  for key in keys:
    section, name = key.split('.')
    if config[section][name] <= 0:
      raise ConfigError(f'{key}={config[section][name]} must be positive.')


def _require_divisible(value: int, value_key: str, by: int, by_name: str) -> None:
  if value % by:
    raise ConfigError(
        f'{value_key}={value} is not divisible by {by_name}={by}; change one of them so that '
        f'{by_name} divides {value_key}.')


def count_slices(devices) -> int:
  """How many TPU slices the devices form (1 off multi-slice TPU pods)."""
  return len({getattr(d, 'slice_index', 0) for d in devices})


def validate(config: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1,
             num_slices: int = 1) -> ml_collections.ConfigDict:
  """Checks the whole config; returns it unchanged or raises ConfigError naming key and fix.
  `num_slices` > 1 (several TPU slices): the dcn axes split the mesh by slice, not by process."""
  unknown = _unknown_keys(config, default_config())
  if unknown:
    raise ConfigError(
        f'Unknown config keys {unknown}; see engine/config.py default_config() for the schema '
        '(a typo in an override?).')
  if config.model.name not in models.MODELS:
    raise ConfigError(f'model.name={config.model.name!r} is unknown; choose one of '
                      f'{sorted(models.MODELS)}.')
  if config.parallelism.mode not in parallel.STEP_BUILDERS:
    raise ConfigError(f'parallelism.mode={config.parallelism.mode!r} is unknown; choose one of '
                      f'{sorted(parallel.STEP_BUILDERS)}.')
  for key, choices in [
      ('data.source', SOURCES), ('data.tokenizer', TOKENIZERS), ('model.dtype', DTYPES),
      ('model.attention', attention.IMPLEMENTATIONS),
      ('model.attention_scale_on', attention.SCALE_ON),
      ('model.remat', tuple(parallel.steps.REMAT_POLICIES)),
      ('optim.weight_decay_on', ('matrices', 'all')),
      ('parallelism.grad_reduce_dtype', DTYPES)]:
    section, name = key.split('.')
    if config[section][name] not in choices:
      raise ConfigError(f'{key}={config[section][name]!r} is unknown; choose one of {choices}.')
  if config.data.source == 'file':
    _check_data_file(config.data.path)
  subword = config.data.tokenizer in ('hf', 'sentencepiece')
  if subword and config.data.source != 'shards' and not os.path.isfile(config.data.tokenizer_path):
    raise ConfigError(
        f'data.tokenizer={config.data.tokenizer!r} reads data.tokenizer_path, but '
        f'{config.data.tokenizer_path!r} is not a file; pass --config.data.tokenizer_path=PATH '
        '(python -m engine.train_tokenizer makes a tokenizer.json from any text).')
  if config.data.source == 'shards' and not config.data.shards:
    raise ConfigError("data.source='shards' reads data.shards, which is empty; pass "
                      '--config.data.shards=DIR (an engine.prepare output; DIR:WEIGHT,... to mix).')
  if config.data.path and config.data.source != 'file':
    raise ConfigError(
        f'data.path={config.data.path!r} is set but data.source={config.data.source!r} does not '
        'read files; add --config.data.source=file, or drop data.path.')
  for key in ('optim.learning_rate', 'optim.end_learning_rate', 'optim.weight_decay',
              'optim.b1', 'optim.b2', 'model.init_std', 'model.norm_eps', 'model.rope_base'):
    section, name = key.split('.')
    if not math.isfinite(config[section][name]):
      raise ConfigError(f'{key}={config[section][name]} is not a finite number; give one.')
  for key in ('optim.b1', 'optim.b2'):
    value = config.optim[key.split('.')[1]]
    if not 0.0 <= value < 1.0:
      raise ConfigError(f'{key}={value} must lie in [0, 1): it is how much of its running '
                        'average Adam keeps each step (usual: b1=0.9, b2 from 0.95 to 0.999).')
  if not config.optim.grad_clip_norm > 0:
    raise ConfigError(f'optim.grad_clip_norm={config.optim.grad_clip_norm} must be positive: '
                      'gradients are scaled down to this global norm (inf turns clipping off).')
  if config.optim.weight_decay < 0:
    raise ConfigError(f'optim.weight_decay={config.optim.weight_decay} must be >= 0.')
  if config.train.skip_nonfinite_steps < 0:
    raise ConfigError(f'train.skip_nonfinite_steps={config.train.skip_nonfinite_steps} must be '
                      '>= 0: 0 stops at the first step that is not finite, N > 0 skips up to N '
                      'in a row.')
  _require_positive(config, [
      'model.num_layers', 'model.num_heads', 'model.embed_dim', 'model.mlp_dim', 'model.max_len',
      'model.vocab_multiple', 'data.seq_len', 'data.global_batch_size', 'train.num_steps',
      'train.log_every', 'train.eval_every', 'train.eval_batches', 'train.checkpoint_every',
      'train.keep_checkpoints', 'train.microbatches', 'train.pipeline_repeats',
      'optim.learning_rate', 'model.norm_eps',
      'model.rope_base', 'data.embedded_max_bytes', 'data.synthetic_tokens'])
  if config.model.vocab_size != -1 and config.model.vocab_size <= 0:
    raise ConfigError(f'model.vocab_size={config.model.vocab_size} must be positive, or -1 to '
                      'take it from the tokenizer.')
  if not 0.0 < config.data.val_fraction < 1.0:
    raise ConfigError(f'data.val_fraction={config.data.val_fraction} must lie in (0, 1).')
  for key in ('optim.warmup_steps', 'optim.end_learning_rate', 'model.init_std'):
    section, name = key.split('.')
    if config[section][name] < 0:
      raise ConfigError(f'{key}={config[section][name]} must be >= 0.')
  if not 0 <= config.seed <= _MAX_SEED:
    raise ConfigError(f'seed={config.seed} must lie in [0, {_MAX_SEED}]: the data order is '
                      'shuffled with 32-bit seeds (evaluation uses seed + 1); give e.g. '
                      '--config.seed=0.')
  if config.optim.decay_steps != -1 and config.optim.decay_steps <= config.optim.warmup_steps:
    raise ConfigError(
        f'optim.decay_steps={config.optim.decay_steps} must exceed optim.warmup_steps='
        f'{config.optim.warmup_steps} (it counts the warmup), or be -1 to end at '
        'train.num_steps.')
  if config.data.seq_len > config.model.max_len:
    raise ConfigError(
        f'data.seq_len={config.data.seq_len} exceeds model.max_len={config.model.max_len}; '
        'raise model.max_len or shorten data.seq_len.')
  _require_divisible(config.model.embed_dim, 'model.embed_dim', config.model.num_heads,
                     'model.num_heads')
  kv_heads = config.model.num_kv_heads
  if kv_heads != -1 and (kv_heads <= 0 or config.model.num_heads % kv_heads):
    raise ConfigError(
        f'model.num_kv_heads={kv_heads} must divide model.num_heads={config.model.num_heads} '
        '(each key/value head serves a group of query heads), or be -1 for one per query head.')
  if config.model.name == 'llama' and (config.model.embed_dim // config.model.num_heads) % 2:
    raise ConfigError(
        f'model.embed_dim / model.num_heads = {config.model.embed_dim // config.model.num_heads} '
        'is odd; rotary embeddings rotate pairs of dimensions, so choose an even head size.')
  if config.train.init_from:
    _check_init_from(config.train.init_from)

  mesh = resolve_mesh_shape(config.mesh, num_devices)
  if config.parallelism.rules not in sharding.RULE_PRESETS and config.parallelism.rules != 'auto':
    raise ConfigError(f'parallelism.rules={config.parallelism.rules!r} is unknown; choose '
                      f"'auto' or one of {sorted(sharding.RULE_PRESETS)}.")
  for axis in ('data', 'fsdp'):
    dcn = config.mesh[f'dcn_{axis}']
    if dcn < 1 or mesh[axis] % dcn:
      raise ConfigError(f'mesh.dcn_{axis}={dcn} must be >= 1 and divide mesh.{axis}={mesh[axis]} '
                        f'(the {axis} axis is split into dcn_{axis} groups across hosts).')
  hosts = config.mesh.dcn_data * config.mesh.dcn_fsdp
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
  rules = sharding.rules_for(config.parallelism.rules, mesh)
  unused = [a for a, size in mesh.items() if size > 1 and a not in rules.mesh_axes_used()]
  if unused:
    raise ConfigError(
        f'parallelism.rules={config.parallelism.rules!r} does not use mesh axes {unused} of size '
        '> 1, so they would only duplicate work; set them to 1 or pick rules that use them.')

  context = mesh['context']
  if context > 1 and config.data.seq_len % (2 * context):
    raise ConfigError(
        f'data.seq_len={config.data.seq_len} must be a multiple of 2*mesh.context={2 * context}: '
        'each device holds two of the 2*context chunks of every sequence (one early, one late, '
        'so that causal attention costs every device the same).')
  if context > 1 and config.parallelism.mode == 'manual' and config.model.attention != 'einsum':
    raise ConfigError(
        f'model.attention={config.model.attention!r} with mesh.context={context} in manual mode: '
        "ring attention computes its own blocks; set model.attention='einsum' (auto mode may "
        'keep it).')

  stages = mesh['stage']
  if stages > 1 and config.model.num_layers % stages:
    raise ConfigError(
        f'model.num_layers={config.model.num_layers} does not split into mesh.stage={stages} '
        'pipeline stages of equal depth; choose a stage count that divides it.')
  repeats = config.train.pipeline_repeats
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
  if config.data.global_batch_size % batch_ways:
    raise ConfigError(
        f'data.global_batch_size={config.data.global_batch_size} does not split over the mesh\'s '
        f'batch axes {"*".join(batch_axes)}={batch_ways}; make it a multiple of {batch_ways}, or '
        'change the mesh.')
  _require_divisible(config.data.global_batch_size, 'data.global_batch_size', num_processes,
                     'the number of processes')
  local_batch = config.data.global_batch_size // batch_ways
  if local_batch % config.train.microbatches:
    raise ConfigError(
        f'train.microbatches={config.train.microbatches} does not divide the {local_batch} rows '
        f'each device holds (data.global_batch_size={config.data.global_batch_size} over '
        f'{batch_ways} batch shards); choose a divisor of {local_batch}, or a larger batch.')
  tensor = mesh['tensor']
  _require_divisible(config.model.num_heads, 'model.num_heads', tensor, 'mesh.tensor')
  _require_divisible(config.model.mlp_dim, 'model.mlp_dim', tensor, 'mesh.tensor')
  if config.model.vocab_size != -1:
    _require_divisible(config.model.vocab_size, 'model.vocab_size', tensor, 'mesh.tensor')
  else:
    _require_divisible(config.model.vocab_multiple, 'model.vocab_multiple', tensor, 'mesh.tensor')
  fsdp = mesh['fsdp']
  _require_divisible(config.model.embed_dim, 'model.embed_dim', fsdp, 'mesh.fsdp')
  return config


def check_parameter_splits(parameters, mesh_shape: dict[str, int]) -> None:
  """Every split dimension of every parameter (engine.state.ParameterInfo) must divide evenly
  over its mesh axes; any model's sizes are checked here, before anything compiles."""
  for p in parameters:
    for dim, (size, name, entry) in enumerate(zip(p.shape, p.logical_axes, p.spec)):
      axes = sharding.spec_axes(P(entry))
      ways = math.prod(mesh_shape[a] for a in axes)
      if size % ways:
        raise ConfigError(
            f'Parameter {p.path} {p.shape}: dimension {dim} ({name!r}, size {size}) is split '
            f'{ways} ways over mesh axes {axes}, which does not divide it; choose model sizes '
            f'that the mesh divides, or rules (parallelism.rules) that do not split {name!r}.')
