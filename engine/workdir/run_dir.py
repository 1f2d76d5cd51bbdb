"""The run's working directory: checks, the recorded config, and paths that may be remote.

Every read and write of the workdir goes through `etils.epath` (as Orbax's do), so a workdir may be
a local path or a bucket URI such as gs://bucket/run (which needs the gcs extra's packages, see
docs/training.md; other schemes are refused: REMOTE_SCHEMES). Local paths are made absolute; URIs
are kept as given.
"""

from __future__ import annotations

import copy
import json

import jax
import ml_collections
from etils import epath

from engine import config as config_lib
from engine import models
from engine.errors import ConfigError

CONFIG_FILE = 'config.json'

# The keys added to the schema since the first runs wrote their config.json, in the order they
# came, each with the value runs before it used (what the engine did before the key existed). A
# key added later gets a row (tests/unit/test_config_value.py reads every earlier schema's
# config.json, tests/support/earlier_configs.jsonl, through this table). The keys a model declares
# itself (engine/models/config_keys.py) need none: their defaults are what runs before them did.
ADDED_KEYS = {
    'mesh.dcn_data': 1,
    'mesh.dcn_fsdp': 1,
    'model.norm_eps': 1e-05,
    'model.attention': 'einsum',
    'model.attention_scale_on': 'queries',
    'model.num_kv_heads': -1,
    'model.dtype': 'float32',
    'model.remat': 'none',
    'optim.weight_decay_on': 'matrices',
    'parallelism.grad_reduce_dtype': 'float32',
    'train.microbatches': 1,
    'train.init_from': '',
    'train.async_checkpoints': True,
    'train.skip_damaged_checkpoints': False,
    'train.skip_nonfinite_steps': 0,
    'mesh.context': 1,
    'mesh.stage': 1,
    'train.pipeline_repeats': 1,
    'data.tokenizer_path': '',
    'data.shards': '',
    'model.attention_scale': -1.0,
    'optim.schedule': 'cosine',
    'optim.decay_fraction': 0.2,
    'train.profile_steps': '',
    'train.sample_every': 0,
    'train.sample_prompt': '',
    'train.sample_tokens': 0,
    'train.sample_temperature': 0.8,
    'mesh.expert': 1,
    'data.document_masking': False,
    'parallelism.fsdp_gather': 'auto',
    'train.pipeline_schedule': '',
    'train.pipeline_head': 'split',
    'model.matmul_precision': 'default',
    'model.matmul_block': 128,
    'parallelism.gather_dtype': 'default',
    'optim.mu_dtype': 'float32',
    'parallelism.optimizer_sharding': 'params',
    'parallelism.offload_optimizer': False,
    'optim.nu_dtype': 'float32',
    'model.loss_chunks': 1,
    'optim.name': 'adamw',
    'optim.muon_learning_rate': 0.02,
    'optim.muon_beta': 0.95,
    'optim.muon_ns_steps': 5,
    'train.compile_cache_dir': 'none',
    'train.hang_timeout_s': 0.0,
    'train.straggler_factor': 0.0,
    'train.local_checkpoint_dir': '',
    'train.local_checkpoint_every': 10,
    'train.loggers': 'tensorboard,jsonl',
    'train.wandb_project': '',
    'train.wandb_entity': '',
    'train.wandb_name': '',
    'train.wandb_mode': '',
}


def is_remote(path: str | epath.Path) -> bool:
  return '://' in str(path)


def resolve(path: str | epath.Path, what: str = '--workdir') -> epath.Path:
  """`path` as an epath.Path: local paths made absolute, URIs (gs://...) untouched, once they
  are known to be reachable (check_uri; `what` names the flag in its error)."""
  if not is_remote(path):
    return epath.Path(path).expanduser().absolute()
  check_uri(str(path), what)
  return epath.Path(path)


# The URI schemes a workdir may use: the setup.cfg extra that brings the packages etils.epath
# reaches each through (Orbax and tensorboardX use them too), and those packages.
REMOTE_SCHEMES = {'gs': ('gcs', 'gcsfs and google-cloud-storage')}
_USABLE_SCHEMES: set[str] = set()  # Those whose packages one access has shown to be there.


def check_uri(uri: str, what: str = '--workdir') -> None:
  """Refuses, in one line, a URI of a scheme the engine does not support, or one whose packages
  are missing (etils.epath raises ImportError only at the first access, so that access is made
  here, once per scheme: every later path resolves without a round trip to the bucket)."""
  scheme = uri.partition('://')[0]
  if scheme in _USABLE_SCHEMES:
    return
  if scheme not in REMOTE_SCHEMES:
    supported = ' or '.join(f'{s}://' for s in REMOTE_SCHEMES)
    raise ConfigError(f'{what}={uri}: {scheme}:// is not supported; pass a local path or a '
                      f'{supported} URI.')
  try:
    epath.Path(uri).exists()
  except ImportError:
    extra, packages = REMOTE_SCHEMES[scheme]
    raise ConfigError(f'{what}={uri}: {scheme}:// paths need {packages} (the {extra} extra), '
                      f'which are not installed; install them with pip install -e ".[{extra}]", '
                      'or pass a local path.') from None
  _USABLE_SCHEMES.add(scheme)


def prepare(workdir: str) -> epath.Path:
  """The workdir, created if missing; it must be a directory this process can write."""
  path = resolve(workdir)
  if path.exists() and not path.is_dir():
    raise ConfigError(f'--workdir={workdir} is a file, not a directory; pass a new path or the '
                      'directory of the run to resume.')
  try:
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f'.write_test.{jax.process_index()}'
    probe.write_text('')
    probe.unlink()
  except OSError as error:
    raise ConfigError(f'--workdir={workdir} cannot be written ({error.strerror or error}); pass '
                      'a path under a writable directory, or fix its permissions.') from error
  return path


def check_resumable(config: ml_collections.ConfigDict, workdir: epath.Path) -> None:
  """Refuses to resume a checkpoint whose model or data config differ from this one: the state
  would not fit, or the run would silently change; so does another optimizer (optim.name), or a
  learning-rate schedule whose end would move with train.num_steps. Mesh, mode, the other optim
  keys and the model's compute keys
  (COMPUTE_KEYS: dtype, remat, matmul precision) may change (but not the circular pipeline's
  layer grouping)."""
  path = workdir / CONFIG_FILE
  if not path.exists():
    return
  saved = json.loads(upgrade(ml_collections.ConfigDict(json.loads(path.read_text()))).to_json())
  for section in ('model', 'data'):
    if _state_keys(saved.get(section), section) != _state_keys(
        json.loads(config[section].to_json()), section):
      raise ConfigError(
          f'--workdir={workdir} holds checkpoints of a run with a different {section} config; '
          f'use a new --workdir, or the {section} settings of {path}.')
  # The circular pipeline stores stacked parameters in groups: another grouping would not fit.
  repeats = saved.get('train', {}).get('pipeline_repeats', 1)
  if repeats != config.train.pipeline_repeats:
    raise ConfigError(
        f'--workdir={workdir} holds checkpoints stored for train.pipeline_repeats={repeats}; '
        f'resume with --config.train.pipeline_repeats={repeats}, or use a new --workdir.')
  # AdamW's state and Muon's differ in structure: a checkpoint restores only into its own.
  optimizer = saved.get('optim', {}).get('name', 'adamw')
  if optimizer != config.optim.name:
    raise ConfigError(
        f'--workdir={workdir} holds checkpoints with optim.name={optimizer!r} state; resume '
        f'with --config.optim.name={optimizer}, or train its weights with '
        f'optim.name={config.optim.name!r} in a new --workdir with '
        f'--config.train.init_from={workdir}.')
  _check_schedule_end(config, saved, workdir)


def _check_schedule_end(config: ml_collections.ConfigDict, saved: dict, workdir) -> None:
  """Refuses a resume whose schedule ends at a train.num_steps other than the saved run's
  schedule end: extending a finished cosine run would otherwise stretch the decay, raising the
  learning rate back up. An end given as optim.decay_steps, or a constant schedule, may change."""
  saved_optim = saved.get('optim', {})
  if (config.optim.decay_steps != -1 or config.optim.schedule == 'constant' or
      saved_optim.get('schedule', 'cosine') == 'constant'):
    return
  saved_steps = saved.get('train', {}).get('num_steps', config.train.num_steps)
  saved_decay = saved_optim.get('decay_steps', -1)
  # A schedule ends one step after its warmup at the earliest (engine/optimizer.py): runs
  # shorter than that share one schedule, and the end it reports is a valid decay_steps.
  saved_warmup = saved_optim.get('warmup_steps', config.optim.warmup_steps)
  saved_end = max(saved_decay if saved_decay > 0 else saved_steps, saved_warmup + 1)
  num_steps = config.train.num_steps
  if max(num_steps, config.optim.warmup_steps + 1) == saved_end:
    return
  keep = (f'--config.train.num_steps={saved_steps} to finish it as planned, '
          if saved_steps == saved_end else '')
  raise ConfigError(
      f'--workdir={workdir} holds a run whose learning-rate schedule ends at step {saved_end}, '
      f'and train.num_steps={num_steps} would move that end to step {num_steps} '
      f'(optim.schedule={config.optim.schedule} with optim.decay_steps=-1 ends at '
      f'train.num_steps); pass --config.optim.decay_steps={saved_end} to keep it (the rate stays '
      f'at its end value after step {saved_end}), {keep}or start a fresh schedule from its '
      f'weights in a new --workdir with --config.train.init_from={workdir}.')


def read_saved(workdir: str) -> dict:
  """A finished run's WORKDIR/config.json as written (the config, and the record of the
  tokenizer it keeps: engine/workdir/tokenizer.py)."""
  path = resolve(workdir) / CONFIG_FILE
  if not path.exists():
    raise ConfigError(f'--workdir={workdir} holds no {CONFIG_FILE}; pass the --workdir of a '
                      'training run.')
  try:
    return json.loads(path.read_text())
  except ValueError as error:
    raise ConfigError(f'--workdir={workdir}: {CONFIG_FILE} is not valid JSON ({error}); it is '
                      'not a file a training run wrote: restore it, or pass another --workdir.'
                      ) from None


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
  """A finished run's config, as its WORKDIR/config.json recorded it (engine.assemble lays it
  out on another mesh for generation, evaluation and export)."""
  saved = read_saved(workdir)
  sections = ('model', 'data', 'train', 'mesh', 'parallelism', 'optim')
  missing = [s for s in sections if not isinstance(saved, dict) or
             not isinstance(saved.get(s), dict)]
  if missing:
    raise ConfigError(f'--workdir={workdir}: {CONFIG_FILE} has no {missing[0]} section; it is '
                      'not a config a training run wrote: restore it, or pass the --workdir of '
                      'a training run.')
  for key in RECORDS:
    saved.pop(key, None)
  return upgrade(ml_collections.ConfigDict(saved))


# Model keys that change how a step computes, not the state a checkpoint holds (float32
# parameters and optimizer state whatever they are): a run may resume with others.
COMPUTE_KEYS = frozenset({'dtype', 'remat', 'matmul_precision', 'matmul_block'})


def _state_keys(section_values: dict | None, section: str) -> dict | None:
  if section != 'model' or section_values is None:
    return section_values
  return {k: v for k, v in section_values.items() if k not in COMPUTE_KEYS}


def upgrade(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A recorded config (a config.json read back) as a copy with the keys an older run lacks
  (ADDED_KEYS, and the models' own keys at their declared defaults) at the values it ran with;
  keys it has are kept. Every read of a saved config.json goes through here, so the back-fills
  live in one place."""
  upgraded = copy.deepcopy(config)
  with upgraded.unlocked():
    for key, value in ADDED_KEYS.items():
      section, leaf = key.split('.')
      if isinstance(upgraded.get(section), ml_collections.ConfigDict) and (
          leaf not in upgraded[section]):
        upgraded[section][leaf] = value
    section = upgraded.get('model')
    if isinstance(section, ml_collections.ConfigDict):
      for key in models.schema_keys():
        if key.name not in section:
          section[key.name] = key.default
  return upgraded


# config.json's records beside the config: the kept tokenizer (engine/workdir/tokenizer.py), the
# shard sets' identities (engine/workdir/shard_sets.py), the processes and mesh the run last
# started on (`layout`: a resume elsewhere says what changed).
RECORDS = ('tokenizer', 'shard_sets', 'layout')


def recorded(workdir: epath.Path, key: str):
  """The record `key` (RECORDS) of the workdir's config.json; None without one."""
  path = workdir / CONFIG_FILE
  return json.loads(path.read_text()).get(key) if path.exists() else None


def write_config(config: ml_collections.ConfigDict, workdir: epath.Path, **records) -> None:
  """Records the config once the run is known to start (never for a run that failed early),
  with `records` (RECORDS; None values left out)."""
  if jax.process_index() == 0:
    saved = json.loads(config.to_json())
    saved.update({key: value for key, value in records.items() if value is not None})
    write_text_atomically(workdir / CONFIG_FILE, json.dumps(saved, indent=2))


def layout(config: ml_collections.ConfigDict) -> dict:
  """config.json's `layout`: this start's processes, devices, mesh and mode."""
  return {'processes': jax.process_count(), 'devices': jax.device_count(),
          'mesh': config_lib.format_mesh(dict(config.mesh)), 'mode': config.parallelism.mode}


def layout_change(config: ml_collections.ConfigDict, workdir: epath.Path) -> str | None:
  """How this start's layout differs from the one config.json records ('2 processes x 4 devices,
  mesh 2x2x2, auto mode -> 1 process x 8 devices, mesh 2x2x2, manual mode'), None if it does
  not or none is recorded."""
  before = recorded(workdir, 'layout')
  now = layout(config)
  if not before or before == now:
    return None

  def describe(facts: dict) -> str:
    processes = facts['processes']
    return (f'{processes} process{"es" if processes > 1 else ""} x '
            f'{facts["devices"] // processes} devices, mesh {facts["mesh"]}, {facts["mode"]} mode')
  return f'{describe(before)} -> {describe(now)}'


def write_text_atomically(path: epath.Path, text: str) -> None:
  """Writes `path` whole or not at all: to a temporary name, then renamed over it."""
  tmp = path.parent / f'{path.name}.tmp'
  tmp.write_text(text)
  tmp.replace(path)
