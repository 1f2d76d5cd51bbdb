"""The config schema and its defaults, experiment arguments, and mesh sizes.

Every experiment file starts from `default_config()` and overrides what it needs, so the schema
lives here once. engine/validation/__init__.py checks a whole tree against it before anything
compiles, raising `engine.errors.ConfigError`. A config is a value once built: a command that varies
one (a mesh, a mode) derives a copy with `with_values`, never rewriting the config it was given.
"""

from __future__ import annotations

import copy
import math
import re

import ml_collections
from ml_collections import ConfigDict

from engine.errors import ConfigError

SOURCES = ('embedded', 'file', 'synthetic', 'shards')
TOKENIZERS = ('byte', 'char', 'hf', 'sentencepiece')
MESH_AXES = ('data', 'fsdp', 'tensor', 'context', 'stage', 'expert')
DTYPES = ('float32', 'bfloat16')
FSDP_GATHERS = ('auto', 'per_layer', 'per_weight')  # parallelism.fsdp_gather
OPTIMIZER_SHARDINGS = ('params', 'zero1')  # parallelism.optimizer_sharding


def default_config() -> ml_collections.ConfigDict:
  """The full schema with its defaults: a tiny GPT on the embedded corpus, one device."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # Parameter initialisation and the data order (evaluation uses seed + 1).

  c.model = ml_collections.ConfigDict()
  c.model.name = 'gpt'  # gpt | llama (engine/models/).
  c.model.num_layers = 2  # Transformer blocks.
  c.model.num_heads = 4  # Attention (query) heads.
  c.model.embed_dim = 64  # Width of the residual stream.
  c.model.mlp_dim = 256  # Hidden width of each block's MLP.
  c.model.max_len = 64  # Learned position embeddings cover this many positions.
  # -1: the tokenizer's vocabulary, rounded up to a multiple of `vocab_multiple` so that it
  # splits over any tensor axis that divides the multiple.
  c.model.vocab_size = -1
  c.model.vocab_multiple = 64  # See vocab_size.
  c.model.tie_embeddings = True  # The output layer reuses the token embeddings.
  c.model.scan_layers = True  # False unrolls the layer loop in the HLO (debugging).
  c.model.init_std = 0.02  # Standard deviation of the initial weights.
  c.model.norm_eps = 1e-5  # Epsilon of the layer norms (RMSNorm in Llama).
  # einsum | dot_product_attention (jax.nn; cuDNN flash on GPUs) | splash (the Pallas TPU
  # flash kernel; Pallas interpret mode on CPU; data.seq_len a multiple of 128; with
  # mesh.context > 1 manual mode only, per ring block: data.seq_len / (2 * context) too).
  c.model.attention = 'einsum'
  c.model.attention_scale_on = 'queries'  # Where 1/sqrt(head_dim) goes: queries | logits.
  # Logits are multiplied by this before the softmax; -1: 1/sqrt(head_dim) (every attention path
  # of both modes: einsum, dot_product_attention, ring attention, the generation cache).
  c.model.attention_scale = -1.0
  c.model.num_kv_heads = -1  # Llama: key/value heads (grouped-query attention); -1: num_heads.
  # The keys only some models read (Llama's head size, rotary settings, experts, ...): each model
  # declares its own with their defaults and help (engine/models/__init__.py: MODEL_KEYS).
  from engine import models  # pylint: disable=g-import-not-at-top
  for key in models.schema_keys():
    c.model[key.name] = key.default
  # Compute dtype: float32 | bfloat16. Parameters and optimizer state stay float32; logits and
  # the loss are float32.
  c.model.dtype = 'float32'
  # How the layers' dense projections multiply (engine/models/quantized_matmul.py): default (in
  # model.dtype) | int8 | fp8 (e4m3 forward, e5m2 gradients), forward and backward, with a scale
  # per channel and per block of matmul_block elements along each contraction.
  c.model.matmul_precision = 'default'
  c.model.matmul_block = 128  # Contraction elements per scale; 128+ keeps TPU's int8 matmuls.
  # What each layer keeps for the backward pass: none (keep all) | full (recompute the layer) |
  # dots_saveable | dots_with_no_batch_dims_saveable (keep matmul outputs) |
  # offload_dots_with_no_batch_dims (the same outputs kept in host memory: TPU, GPU).
  c.model.remat = 'none'
  # The training and evaluation loss apply the head to this many slices of the positions in
  # turn, each projected again in the backward pass: the float32 logits [batch, length, vocab]
  # of the whole batch never exist (one slice's at a time). Must divide data.seq_len / mesh.context.
  c.model.loss_chunks = 1

  c.data = ml_collections.ConfigDict()
  c.data.source = 'embedded'  # embedded | file | synthetic | shards
  c.data.path = ''  # Text file, for source='file'.
  # byte | char | hf (a tokenizer.json) | sentencepiece (a .model); for shards, the kind they
  # were written with (engine.data.prepare; data.tokenizer_path may stay '': the recorded file).
  c.data.tokenizer = 'byte'
  c.data.tokenizer_path = ''  # For tokenizer='hf' or 'sentencepiece'.
  # For source='shards': an engine.data.prepare output directory, or DIR:WEIGHT,DIR:WEIGHT to mix
  # several by weight.
  c.data.shards = ''
  c.data.seq_len = 64  # Tokens per training sequence (at most model.max_len).
  c.data.global_batch_size = 16  # Sequences per step, over all devices.
  c.data.val_fraction = 0.1  # The last fraction of the tokens, held out for the eval loss.
  c.data.embedded_max_bytes = 2_000_000  # How much of the embedded corpus to read.
  c.data.synthetic_tokens = 100_000  # Corpus length for source='synthetic'.
  # A window packs several documents, each ended by the tokenizer's end-of-text id: attention
  # never crosses documents, positions restart at 0 in each, and the loss skips the prediction
  # from an end-of-text token (training and evaluation; needs a tokenizer with that id).
  c.data.document_masking = False

  c.optim = ml_collections.ConfigDict()
  # adamw | muon: Muon (optax's) on the layers' matrices, AdamW (the keys below) on embeddings,
  # head, norms and biases (engine/muon.py).
  c.optim.name = 'adamw'
  c.optim.learning_rate = 1e-3  # Peak learning rate, reached after warmup_steps.
  c.optim.end_learning_rate = 1e-4  # Where cosine and wsd end; constant ignores it.
  c.optim.warmup_steps = 20  # Linear warmup from 0 to learning_rate.
  # Learning rate by step, each after a linear warmup (engine/optimizer.py): cosine (decay to
  # end_learning_rate) | constant (the peak) | wsd (the peak, then a linear decay to
  # end_learning_rate over the last decay_fraction of the steps).
  c.optim.schedule = 'cosine'
  # Where cosine and wsd reach end_learning_rate (warmup included); -1: at train.num_steps.
  # Pin it to extend a finished run at its final rate (docs/training.md); constant has no end.
  c.optim.decay_steps = -1
  c.optim.decay_fraction = 0.2  # wsd only: the share of decay_steps (or num_steps) spent decaying.
  c.optim.b1 = 0.9  # Adam's first-moment decay.
  c.optim.b2 = 0.99  # Adam's second-moment decay.
  # Adam's first moment stored as float32 | bfloat16 (half its memory; computed in float32 each
  # step; the parameters and their update stay float32).
  c.optim.mu_dtype = 'float32'
  c.optim.nu_dtype = 'float32'  # Adam's second moment stored as float32 | bfloat16 (as mu_dtype).
  c.optim.weight_decay = 0.1  # AdamW's decoupled weight decay.
  c.optim.weight_decay_on = 'matrices'  # matrices (not norms, biases) | all
  c.optim.grad_clip_norm = 1.0  # Global norm the gradients are scaled down to; inf: off.
  # Muon's peak learning rate, on the same schedule (its end scaled alike); learning_rate is
  # then the AdamW part's.
  c.optim.muon_learning_rate = 0.02
  c.optim.muon_beta = 0.95  # Muon's momentum decay (Nesterov).
  c.optim.muon_ns_steps = 5  # Newton-Schulz iterations per matrix and step.

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1: all devices the other axes leave.
  c.mesh.fsdp = 1  # Parameters and optimizer state sharded over this many devices.
  c.mesh.tensor = 1  # Tensor parallelism: heads and MLP width split this many ways.
  # Context (sequence) parallelism: each sequence split over this many devices; manual mode runs
  # ring attention over them (engine/parallel/context.py).
  c.mesh.context = 1
  # Pipeline parallelism: the stacked layers split into this many stages, fed train.microbatches
  # micro-batches on a GPipe schedule (engine/parallel/pipeline/gpipe.py).
  c.mesh.stage = 1
  # Expert parallelism: a mixture of experts' experts split over this many devices, tokens sent
  # to them by all-to-all; it also splits the batch, like data (docs/parallelism.md).
  c.mesh.expert = 1
  # How many hosts (or TPU slices) the data / fsdp axes span: those axes are laid out across the
  # slow inter-host network and everything else within a host. 1 = no preference.
  c.mesh.dcn_data = 1
  c.mesh.dcn_fsdp = 1  # See dcn_data.

  c.parallelism = ml_collections.ConfigDict()
  c.parallelism.mode = 'auto'  # auto (GSPMD from shardings) | manual (shard_map).
  c.parallelism.rules = 'auto'  # A preset in engine.sharding.RULE_PRESETS; 'auto' follows the mesh.
  # Manual mode: dtype of the gradient reductions and of the FSDP gathers they transpose.
  c.parallelism.grad_reduce_dtype = 'float32'  # float32 | bfloat16
  # Adam's moments: params (laid out as their parameters) | zero1 (also split over the batch
  # axes their parameter is replicated on: ZeRO-1, engine/parallel/zero1.py).
  c.parallelism.optimizer_sharding = 'params'
  # The optimizer state in host memory between steps, moved to the devices for each update
  # (TPU, GPU; a CPU run refuses it).
  c.parallelism.offload_optimizer = False
  # Manual FSDP: what the weight gathers send: default (grad_reduce_dtype) | int8 | fp8, 1-byte
  # values with a float32 scale per shard and channel, dequantized after the gather; gradients
  # are reduce-scattered in grad_reduce_dtype (engine/parallel/quantized_gather.py).
  c.parallelism.gather_dtype = 'default'
  # Manual FSDP: per_layer gathers a layer's split weights in one all_gather (and reduce-scatters
  # their gradients in one), per_weight one collective per weight; auto: per_layer on CPU
  # devices, whose compiler combines neither, per_weight on GPU / TPU, whose compilers do.
  c.parallelism.fsdp_gather = 'auto'  # auto | per_layer | per_weight

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 300  # Optimizer steps in all (a resumed run continues to it).
  c.train.log_every = 25  # Steps between log lines.
  c.train.eval_every = 100  # Steps between eval losses (and one at the end).
  c.train.eval_batches = 8  # Held-out batches per eval loss.
  c.train.checkpoint_every = 100  # Steps between checkpoints (and one at the end).
  c.train.keep_checkpoints = 3  # How many of the newest checkpoints are kept.
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
  # 'gpipe' | 'circular' | '1f1b' | 'interleaved_1f1b' | 'zb_h1' ('': GPipe, or circular when
  # pipeline_repeats > 1). 1F1B runs each micro-batch's backward pass as soon as its forward
  # pass has been through every stage, so a stage holds at most 2 * stage - 1 micro-batches'
  # inputs instead of every micro-batch's activations, for one more forward pass of each stage;
  # interleaved 1F1B does so on pipeline_repeats groups per stage, as circular lays them out
  # (microbatches a multiple of stage); zb_h1 is 1F1B with the weight gradients taken in a pass
  # of their own, in step on every stage: a smaller bubble for stage items' projection inputs
  # and cotangents per stage (engine/parallel/pipeline/one_f_one_b.py).
  c.train.pipeline_schedule = ''
  # Where 1F1B (plain or interleaved) runs the output head and the loss of a finished
  # micro-batch: 'split' over the stages, each on 1 / stage of its rows, or of its positions
  # where the rows do not divide (the last stage's output reduce-scattered to them, the
  # cotangents gathered back; the last stage alone where neither divides), or 'last_stage'.
  c.train.pipeline_head = 'split'
  # A:B: a jax.profiler trace of steps A to B (both included) into WORKDIR/profile, for
  # TensorBoard's profile plugin (docs/training.md, "Profiling"). '': no trace.
  c.train.profile_steps = ''
  # N > 0: every N steps, after the eval, log a sample of the model's text from the live
  # parameters (engine/train/samples.py, as nanoGPT does); 0: none.
  c.train.sample_every = 0
  # The sample's prompt; '': the tokenizer's beginning-of-text token, or a newline without one.
  c.train.sample_prompt = ''
  # New tokens per sample; 0: 64, or fewer if a GPT model's learned positions leave fewer.
  c.train.sample_tokens = 0
  c.train.sample_temperature = 0.8  # 0: greedy. The key of step S's sample is seed S.
  # Start from the parameters (not the optimizer state) of another run's latest checkpoint:
  # that run's --workdir. Used only when this workdir has no checkpoint yet.
  c.train.init_from = ''
  # JAX's persistent compilation cache, so that a restart reads the compiled programs back
  # (engine/runtime/compile_cache.py): '' WORKDIR/compile_cache (or JAX_COMPILATION_CACHE_DIR
  # where set), 'none' no cache, or a directory shared by runs (local or gs://...).
  c.train.compile_cache_dir = ''
  # Fast per-host storage (a local disk or RAM disk) for a second tier of checkpoints, saved
  # every train.local_checkpoint_every steps by each process into its own directory; a restart
  # resumes from the newest complete checkpoint of either tier (engine/workdir/checkpoint_tiers.py).
  # '': the workdir's checkpoints only.
  c.train.local_checkpoint_dir = ''
  c.train.local_checkpoint_every = 10  # Steps between local checkpoints (with the dir set).
  # A step (or evaluation, or save) that has not finished after this many seconds ends the run
  # with one error line naming the processes that did not reach it, each process's Python stacks
  # in WORKDIR/stacks/ (engine/train/watchdog.py); 0: never. The first step is not timed.
  c.train.hang_timeout_s = 1800.0
  # Several processes: warn when a process's host time per step (its own work, not waiting for
  # the devices) exceeds this factor times the median of the others'; 0: never.
  c.train.straggler_factor = 2.0
  # Where the metrics go, comma-separated: jsonl (WORKDIR/metrics.jsonl, always: summary.json
  # and sweeps read it), tensorboard (WORKDIR/tensorboard), wandb (Weights & Biases; the wandb
  # extra): engine/loggers/.
  c.train.loggers = 'tensorboard,jsonl'
  c.train.wandb_project = ''  # '': "engine".
  c.train.wandb_entity = ''  # The W&B team or user; '': the account's default.
  c.train.wandb_name = ''  # The W&B run's name; '': the workdir's last path component.
  # 'online', 'offline' (written under WORKDIR/wandb, uploaded later by `wandb sync`), or '':
  # WANDB_MODE, else online.
  c.train.wandb_mode = ''
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
  """The experiment arguments every experiment takes: mode=, mesh=DxFxT[xC[xS[xE]]] (parse_mesh),
  steps=N (+ extra)."""
  return parse_arg(arg, mode='auto', mesh='', steps=steps, **extra)


def apply_run_args(config: ml_collections.ConfigDict, args) -> ml_collections.ConfigDict:
  """Sets parallelism.mode, the mesh shape (if given) and train.num_steps from parse_run_arg."""
  config.parallelism.mode = args.mode
  if args.mesh:
    set_mesh_shape(config, args.mesh)
  config.train.num_steps = args.steps
  return config


PROFILE_STEPS_EXAMPLE = '10:12'


def parse_profile_steps(text: str, num_steps: int) -> tuple[int, int] | None:
  """train.profile_steps' (first, last) step to trace, both included; None for ''. ConfigError
  if not A:B with 1 <= A <= B <= num_steps."""
  if not text:
    return None
  parts = str(text).split(':')
  try:
    first, last = (int(p) for p in parts) if len(parts) == 2 else (None, None)
  except ValueError:
    first = last = None
  if first is None:
    raise ConfigError(f'train.profile_steps={text!r} must be A:B, the first and last step to '
                      f'trace, e.g. {PROFILE_STEPS_EXAMPLE}.')
  if not 1 <= first <= last <= num_steps:
    raise ConfigError(f'train.profile_steps={text!r} must have 1 <= A <= B <= '
                      f'train.num_steps={num_steps}; e.g. 10:12 traces steps 10, 11 and 12.')
  return first, last


MESH_FORMAT = 'DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]]'


def parse_mesh(text: str, where: str = 'mesh') -> dict[str, int]:
  """Every flag or argument that takes a mesh reads it here: 'DxFxT' up to 'DxFxTxCxSxE'
  (data x fsdp x tensor [x context [x stage [x expert]]]) -> the sizes of all six axes, those not
  given 1. The sizes themselves (positive, or one -1) are checked with the devices
  (resolve_mesh_shape)."""
  sizes = text.split('x')
  if len(sizes) not in (3, 4, 5, 6) or not all(re.fullmatch(r'-?[0-9]+', size) for size in sizes):
    raise ConfigError(f'{where}={text}: a mesh is {MESH_FORMAT}, 3 to 6 integers joined by x '
                      '(axes not given are 1); e.g. 2x2x2, 2x1x1x2x2 for context 2 and stage 2, or '
                      '1x1x1x1x1x4 for expert 4 (-1: the devices the other axes leave, e.g. '
                      '-1x1x2).')
  given = dict(zip(MESH_AXES, (int(size) for size in sizes)))
  return {axis: given.get(axis, 1) for axis in MESH_AXES}


def format_mesh(sizes, all_axes: bool = False) -> str:
  """Mesh sizes (a dict or the mesh section; an axis left out is 1) as parse_mesh reads them:
  '2x2x2', with context, stage and expert only up to the last that is not 1, or all six with
  `all_axes`."""
  values = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
  while not all_axes and len(values) > 3 and values[-1] == 1:
    values.pop()
  return 'x'.join(str(size) for size in values)


def set_mesh_shape(config: ml_collections.ConfigDict, shape: str, where: str = 'mesh') -> None:
  """Sets all six mesh axes from a mesh string (parse_mesh): an axis the string leaves out is
  1, whatever the config held before."""
  for axis, size in parse_mesh(shape, where).items():
    config.mesh[axis] = size


def mesh_values(shape: str, where: str = 'mesh') -> dict[str, int]:
  """A mesh string (parse_mesh) as with_values takes it: {'mesh.data': 2, ...}, all six axes
  (an axis the string leaves out is 1, whatever the config held before)."""
  return {f'mesh.{axis}': size for axis, size in parse_mesh(shape, where).items()}


def with_values(config: ConfigDict, values: dict[str, object]) -> ConfigDict:
  """A deep copy of `config` with dotted keys set ({'parallelism.mode': 'manual', 'mesh.data':
  2}): a command changes its own copy, never the config it was given, which its caller may
  still read or pass on. Raises KeyError naming a key the config does not have."""
  changed = copy.deepcopy(config)
  for key, value in values.items():
    *sections, leaf = key.split('.')
    section = changed
    for name in sections:
      section = section.get(name) if isinstance(section, ConfigDict) else None
    if not isinstance(section, ConfigDict) or leaf not in section:
      raise KeyError(f'{key}: the config has no such key (engine/config.py, default_config())')
    section[leaf] = value
  return changed


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
    shown = [a for a in MESH_AXES if a not in ('context', 'stage', 'expert') or sizes[a] != 1]
    raise ConfigError(
        f'mesh: {"*".join(shown)} = {"*".join(str(sizes[a]) for a in shown)} = {fixed}, '
        f'but there {"is 1 device" if num_devices == 1 else f"are {num_devices} devices"}; '
        f'make the product {num_devices} or set one axis to -1.')
  return sizes
