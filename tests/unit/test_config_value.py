"""The config is a value: commands change copies (engine.config.with_values), assemble.check
returns the config it adjusted and leaves its input alone, the mode reaches the step builders as
an argument, and an older run's config.json is upgraded by one table (run_dir.ADDED_KEYS)."""

import json
import pathlib

import jax
import pytest

from engine import assemble, models, parallel
from engine.analysis import benchmark
from engine.analysis.hf_check import engine_side as hf_compare
from engine.config import default_config, flat_defaults, mesh_values, with_values
from engine.errors import ConfigError
from engine.sweep import grid
from engine.workdir import run_dir
from tests.support.helpers import tiny_config

HF_CONFIG = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 64,
    'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4,
    'num_key_value_heads': 2, 'vocab_size': 256, 'rope_theta': 10000.0, 'rms_norm_eps': 1e-5,
    'max_position_embeddings': 64, 'hidden_act': 'silu', 'tie_word_embeddings': False,
}


def test_with_values_sets_dotted_keys_on_a_copy():
  config = tiny_config()
  before = config.to_dict()
  changed = with_values(config, {'parallelism.mode': 'manual', 'mesh.data': 2, 'seed': 7})
  assert (changed.parallelism.mode, changed.mesh.data, changed.seed) == ('manual', 2, 7)
  assert config.to_dict() == before
  changed.model.num_layers = 9  # The copy is deep: its sections are its own.
  assert config.model.num_layers == before['model']['num_layers']


@pytest.mark.parametrize('key', ['mesh.dat', 'modle.name', 'model.name.x', 'nope', ''])
def test_with_values_refuses_an_unknown_key_by_name(key):
  config = tiny_config()
  before = config.to_dict()
  with pytest.raises(KeyError, match=repr(key)[1:-1] or 'no such key'):
    with_values(config, {'seed': 1, key: 1})
  assert config.to_dict() == before


def test_mesh_values_give_all_six_axes():
  assert mesh_values('2x2x2') == {'mesh.data': 2, 'mesh.fsdp': 2, 'mesh.tensor': 2,
                                  'mesh.context': 1, 'mesh.stage': 1, 'mesh.expert': 1}
  config = with_values(tiny_config(mesh=(1, 1, 8)), mesh_values('1x1x1x1x1x8'))
  assert config_mesh(config) == (1, 1, 1, 1, 1, 8)
  with pytest.raises(ConfigError, match='--meshes=2x2'):
    mesh_values('2x2', '--meshes')


def config_mesh(config):
  return tuple(config.mesh[a] for a in ('data', 'fsdp', 'tensor', 'context', 'stage', 'expert'))


def test_check_returns_the_adjusted_config_and_leaves_its_input(tmp_path):
  """train.init_from=hf:DIR changes the model settings: in the returned copy only."""
  (tmp_path / 'config.json').write_text(json.dumps(HF_CONFIG))
  config = tiny_config()
  config.train.init_from = f'hf:{tmp_path}'
  config.model.max_len = 64
  before = config.to_dict()
  checked = assemble.check(config, jax.devices()[:1])
  assert config.to_dict() == before
  assert (checked.model.name, checked.model.embed_dim, checked.model.num_kv_heads) == (
      'llama', 64, 2)
  plain = tiny_config()
  assert assemble.check(plain, jax.devices()[:1]).to_dict() == plain.to_dict()


def test_assemble_leaves_its_input_and_runs_either_mode():
  config = tiny_config()
  before = config.to_dict()
  run = assemble.assemble(config, jax.devices()[:1], reads=assemble.VOCABULARY)
  assert config.to_dict() == before and run.config is not config
  manual = run.steps_for('manual')
  assert run.steps_for('manual') is manual and run.steps is run.steps_for('auto')
  assert run.steps is not manual and run.config.parallelism.mode == 'auto'
  with pytest.raises(ConfigError, match="parallelism.mode='both' is unknown"):
    parallel.build_steps('both', run.setup)


def test_commands_change_copies():
  """The bench's dense equivalent and the sweep's variants: copies; the input is unchanged."""
  config = tiny_config(mesh=(2, 1, 1))
  config.model.name, config.model.num_experts, config.mesh.expert = 'llama', 4, 4
  before = config.to_dict()
  dense = benchmark.dense_equivalent(config)
  assert (dense.mesh.data, dense.mesh.expert, dense.model.num_experts) == (8, 1, 0)
  variant = grid.variants([('mode', ['manual']), ('mesh', ['1x2x4'])])[0]
  swept = grid.variant_config(config, variant)
  assert swept.parallelism.mode == 'manual' and config_mesh(swept) == (1, 2, 4, 1, 1, 1)
  assert config.to_dict() == before
  hf = hf_compare.engine_config('/ckpt', 'manual', '2x2x2', 4, 16)
  assert (hf.parallelism.mode, hf.train.init_from, hf.data.global_batch_size) == (
      'manual', 'hf:/ckpt', 4)
  assert default_config().to_dict()['parallelism']['mode'] == 'auto'


# Keys older runs' config.json lack, named here so that a row dropped from ADDED_KEYS fails.
OLDER_RUNS_LACK = ('mesh.expert', 'mesh.dcn_data', 'model.sliding_window', 'optim.schedule',
                   'parallelism.fsdp_gather', 'train.pipeline_repeats', 'model.moe_balance',
                   'model.moe_dense_layers', 'model.mla_kv_rank', 'optim.mu_dtype',
                   'parallelism.optimizer_sharding')


# What an older config.json gains: ADDED_KEYS' rows, and the models' own keys at their defaults.
BACKFILLED = {**{f'model.{key.name}': key.default for key in models.schema_keys()},
              **run_dir.ADDED_KEYS}


def _old_config_json(tmp_path, **kept):
  """config.json of a run older than every key of ADDED_KEYS (those in `kept` stay)."""
  saved = json.loads(tiny_config().to_json())
  for key in set(BACKFILLED) | set(OLDER_RUNS_LACK):
    section, leaf = key.split('.')
    if key not in kept:
      del saved[section][leaf]
  for key, value in kept.items():
    section, leaf = key.split('.')
    saved[section][leaf] = value
  (tmp_path / run_dir.CONFIG_FILE).write_text(json.dumps(saved))
  return saved


def test_added_keys_are_schema_keys():
  defaults = flat_defaults()
  assert all(key in defaults for key in run_dir.ADDED_KEYS), set(run_dir.ADDED_KEYS) - set(
      defaults)
  # A model's own keys are back-filled at their declared defaults, not by a row.
  declared = {f'model.{key.name}' for key in models.schema_keys()}
  assert 'model.lora_rank' in declared and not declared & set(run_dir.ADDED_KEYS)


def test_upgrade_fills_an_old_config_json_and_keeps_what_it_has(tmp_path):
  _old_config_json(tmp_path, **{'mesh.expert': 2})
  config = run_dir.read_run_config(str(tmp_path))
  for key in set(BACKFILLED) | set(OLDER_RUNS_LACK):
    section, leaf = key.split('.')
    want = 2 if key == 'mesh.expert' else BACKFILLED[key]
    assert config[section][leaf] == want, key
  config = assemble.assemble_finished_run(str(tmp_path), '1x1x1', reads=assemble.VOCABULARY).config
  assert (config.model.sliding_window, config.parallelism.fsdp_gather) == (0, 'auto')


def test_upgrade_copies():
  old = tiny_config()
  with old.unlocked():
    del old.mesh['expert']
  before = old.to_dict()
  upgraded = run_dir.upgrade(old)
  assert upgraded.mesh.expert == 1 and old.to_dict() == before and 'expert' not in old.mesh


def test_an_old_run_resumes_with_the_keys_it_lacked(tmp_path):
  """check_resumable reads config.json through upgrade: a run older than model.sliding_window
  resumes with the current config, and a real difference is still refused."""
  _old_config_json(tmp_path)
  run_dir.check_resumable(tiny_config(), run_dir.resolve(str(tmp_path)))
  other = with_values(tiny_config(), {'model.sliding_window': 8})
  with pytest.raises(ConfigError, match='different model config'):
    run_dir.check_resumable(other, run_dir.resolve(str(tmp_path)))


def _earlier_configs():
  """The default config.json of every earlier schema (each distinct set of keys the engine's
  history wrote, oldest first), as recorded in tests/support/earlier_configs.jsonl."""
  path = pathlib.Path(__file__).parents[1] / 'support' / 'earlier_configs.jsonl'
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize('earlier', _earlier_configs(), ids=lambda e: e['written'])
def test_every_earlier_schema_is_read_and_resumed(tmp_path, earlier):
  """A run directory of each earlier schema: every key of today's schema is read back (no
  KeyError in the commands that read it), and resuming it with its own values is no 'different
  model config'."""
  saved = earlier['config']
  (tmp_path / run_dir.CONFIG_FILE).write_text(json.dumps(saved))
  config = run_dir.read_run_config(str(tmp_path))
  schema = set(_flat(json.loads(default_config().to_json())))
  assert schema <= set(_flat(json.loads(config.to_json()))), schema - set(_flat(config))
  own = {key: value for key, value in _flat(saved).items() if key in schema}
  run_dir.check_resumable(with_values(default_config(), own), run_dir.resolve(str(tmp_path)))
  assembled = assemble.assemble_finished_run(str(tmp_path), '1x1x1', reads=assemble.VOCABULARY)
  assert assembled.config.model.num_experts == 0


def _flat(config) -> dict:
  config = config if isinstance(config, dict) else json.loads(config.to_json())
  return {f'{section}.{key}': value for section, values in config.items()
          if isinstance(values, dict) for key, value in values.items()}


def test_every_key_added_since_the_first_schema_has_a_row():
  """A key added to the schema fails here until ADDED_KEYS says what older runs did without it
  (or a model declares it: its default is that)."""
  first = set(_flat(_earlier_configs()[0]['config']))
  added = set(_flat(default_config())) - first
  rows = set(run_dir.ADDED_KEYS) | {key for key in BACKFILLED if key not in first}
  assert added == rows, (added - rows, rows - added)
