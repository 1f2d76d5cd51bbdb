"""Config validation: every bad value is refused early with a message naming the key and fix."""

import importlib.util
import json
import os

import jax
import pytest

from engine import assemble, models
from engine.assemble import check
from engine.workdir import run_dir as workdir
from engine.config import default_config, parse_arg, resolve_mesh_shape
from engine.errors import ConfigError
from engine.models.config_keys import ModelConfigError
from engine.validation import validate
from tests.support.bad_input_checks import ROOT
from tests.support.helpers import tiny_config


def _expect(config, *fragments, devices=8, processes=1):
  with pytest.raises(ConfigError) as error:
    validate(config, devices, processes)
  for fragment in fragments:
    assert fragment in str(error.value), str(error.value)


def test_default_and_tiny_configs_validate():
  validate(default_config(), 1)
  validate(tiny_config(mesh=(2, 2, 2)), 8)
  validate(tiny_config(mesh=(-1, 1, 2)), 8)


def test_unknown_key():
  c = default_config()
  c.unlock()
  c.model.num_layerz = 3
  _expect(c, 'model.num_layerz', 'default_config')


def test_mesh_product_must_equal_device_count():
  c = tiny_config(mesh=(2, 2, 1))
  _expect(c, 'data*fsdp*tensor = 2*2*1 = 4', '8 devices')


def test_a_mesh_too_large_for_the_cpu_names_the_flag_that_simulates_devices():
  fix = 'set one axis to -1'
  simulate = ('; on CPU, simulate 8 devices by starting the command with '
              'XLA_FLAGS=--xla_force_host_platform_device_count=8.')
  with pytest.raises(ConfigError) as error:
    validate(tiny_config(mesh=(2, 2, 2)), 1, platform='cpu')
  assert str(error.value) == ('mesh: data*fsdp*tensor = 2*2*2 = 8, but there is 1 device; make the '
                              f'product 1 or {fix}{simulate}')
  # Real devices cannot be simulated; a mesh smaller than the devices needs none simulated.
  _expect(tiny_config(mesh=(2, 2, 2)), f'{fix}.', devices=1)
  with pytest.raises(ConfigError, match=f'{fix}.$'):
    validate(tiny_config(mesh=(2, 2, 2)), 1, platform='tpu')
  with pytest.raises(ConfigError, match=f'{fix}.$'):
    validate(tiny_config(mesh=(2, 1, 1)), 8, platform='cpu')
  # With a -1, the fixed axes are the devices needed.
  with pytest.raises(ConfigError, match='device_count=16.$'):
    validate(tiny_config(mesh=(-1, 4, 4)), 8, platform='cpu')
  # Through every command's path: engine.assemble passes the devices' platform.
  with pytest.raises(ConfigError, match='device_count=16.$'):
    check(tiny_config(mesh=(16, 1, 1)), jax.devices())


def test_mesh_minus_one_fills_the_rest():
  assert resolve_mesh_shape({'data': -1, 'fsdp': 2, 'tensor': 1}, 8) == {
      'data': 4, 'fsdp': 2, 'tensor': 1, 'context': 1, 'stage': 1, 'expert': 1}
  assert resolve_mesh_shape({'data': 2, 'fsdp': 1, 'tensor': 1, 'context': -1}, 8) == {
      'data': 2, 'fsdp': 1, 'tensor': 1, 'context': 4, 'stage': 1, 'expert': 1}
  _expect(tiny_config(mesh=(-1, 3, 1)), 'does not divide', 'mesh.data=-1')
  _expect(tiny_config(mesh=(-1, -1, 1)), 'only one axis may be -1')
  _expect(tiny_config(mesh=(0, 8, 1)), 'mesh.data=0')


def test_an_older_runs_config_gains_the_keys_added_since(tmp_path):
  """generate / evaluate / export read config.json of runs older than mesh.expert (and the
  other keys read_run_config fills): the missing keys get the values those runs used."""
  saved = json.loads(default_config().to_json())
  for section, key in (('mesh', 'expert'), ('optim', 'schedule'), ('train', 'pipeline_repeats')):
    del saved[section][key]
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(saved))
  config = workdir.read_run_config(str(tmp_path))
  assert (config.mesh.expert, config.optim.schedule, config.train.pipeline_repeats) == (
      1, 'cosine', 1)
  assert resolve_mesh_shape(config.mesh, 8) == {'data': 8, 'fsdp': 1, 'tensor': 1, 'context': 1,
                                                'stage': 1, 'expert': 1}


def test_global_batch_must_split_over_batch_axes():
  c = tiny_config(mesh=(4, 2, 1))
  c.data.global_batch_size = 12
  _expect(c, 'data.global_batch_size=12', 'data*fsdp=8')


def test_global_batch_must_split_over_processes():
  c = tiny_config(mesh=(1, 1, 8))
  c.model.num_heads = 8
  c.model.embed_dim = 64
  c.model.mlp_dim = 64
  c.data.global_batch_size = 6
  _expect(c, 'data.global_batch_size=6', 'number of processes=4', processes=4)


@pytest.mark.parametrize('key, value, fragment', [
    ('num_heads', 6, 'model.num_heads=6'),
    ('mlp_dim', 62, 'model.mlp_dim=62'),
    ('vocab_size', 66, 'model.vocab_size=66'),
])
def test_tensor_axis_must_divide_model_dims(key, value, fragment):
  c = tiny_config(mesh=(2, 1, 4))
  c.model[key] = value
  if key == 'num_heads':
    c.model.embed_dim = 48
  _expect(c, fragment, 'mesh.tensor=4')


def test_fsdp_axis_must_divide_embed():
  c = tiny_config(mesh=(1, 8, 1))
  c.model.embed_dim = 36
  c.model.num_heads = 4
  _expect(c, 'model.embed_dim=36', 'mesh.fsdp=8')


def test_unknown_mode_model_source_tokenizer():
  for section, key in [('parallelism', 'mode'), ('model', 'name'), ('data', 'source'),
                       ('data', 'tokenizer')]:
    c = tiny_config()
    c[section][key] = 'nope'
    _expect(c, f"{section}.{key}='nope'", 'choose', devices=1)


def test_missing_data_file():
  c = tiny_config()
  c.data.source = 'file'
  c.data.path = '/no/such/file.txt'
  _expect(c, "data.path='/no/such/file.txt'", '--config.data.path', devices=1)
  # A command that needs only the vocabulary (engine.plan, show_layout, export) reads no text;
  # a character vocabulary comes from the text, so assemble still asks for the file unless the
  # vocabulary is given (a finished run's kept copy).
  validate(c, 1, reads_text=False)
  c.data.tokenizer = 'char'
  _expect(c, "data.path='/no/such/file.txt'", '--config.data.path', devices=1)
  with pytest.raises(ConfigError, match="data.path='/no/such/file.txt'"):
    assemble.assemble(c, jax.devices()[:1], reads=assemble.VOCABULARY)


@pytest.mark.parametrize('key', ['model.num_layers', 'model.embed_dim', 'data.seq_len',
                                 'data.global_batch_size', 'train.num_steps',
                                 'optim.learning_rate'])
def test_non_positive_sizes(key):
  c = tiny_config()
  section, name = key.split('.')
  c[section][name] = 0
  _expect(c, f'{key}=0', 'positive', devices=1)


def test_rules_that_leave_a_mesh_axis_unused():
  c = tiny_config(mesh=(4, 2, 1))
  c.parallelism.rules = 'data_parallel'
  _expect(c, "parallelism.rules='data_parallel'", "['fsdp']")


def test_sequence_longer_than_positions():
  c = tiny_config()
  c.data.seq_len = 32
  _expect(c, 'data.seq_len=32', 'model.max_len=16', devices=1)


def test_parse_arg_types_values_by_defaults():
  args = parse_arg('mode=manual,mesh=2x2x2,steps=7', mode='auto', mesh='', steps=1)
  assert (args.mode, args.mesh, args.steps) == ('manual', '2x2x2', 7)
  with pytest.raises(ConfigError, match="Unknown experiment argument 'stpes'"):
    parse_arg('stpes=3', steps=1)


def test_cross_host_axes_must_divide_and_match_the_processes():
  c = tiny_config(mesh=(4, 2, 1))
  c.mesh.dcn_data = 3
  _expect(c, 'mesh.dcn_data=3', 'divide mesh.data=4')
  c.mesh.dcn_data = 2
  _expect(c, 'mesh.dcn_data*mesh.dcn_fsdp=2', 'number of processes (1)')
  validate(c, 8, num_processes=2)


@pytest.mark.parametrize('key, value, fragments', [
    # Values that used to pass validation and train wrong.
    ('optim.grad_clip_norm', 0.0, ('optim.grad_clip_norm=0.0', 'positive')),
    ('optim.grad_clip_norm', -1.0, ('optim.grad_clip_norm=-1.0', 'inf turns clipping off')),
    ('optim.b1', 1.0, ('optim.b1=1.0', '[0, 1)')),
    ('optim.b2', -0.5, ('optim.b2=-0.5', '[0, 1)')),
    ('optim.learning_rate', float('nan'), ('optim.learning_rate=nan', 'not a finite number')),
    ('optim.learning_rate', float('inf'), ('optim.learning_rate=inf', 'not a finite number')),
    ('optim.weight_decay', -0.1, ('optim.weight_decay=-0.1', '>= 0')),
    ('data.path', 'notes.txt', ("data.path='notes.txt' is set but data.source='synthetic'",
                                '--config.data.source=file')),
])
def test_values_that_would_train_wrong(key, value, fragments):
  c = tiny_config()
  section, name = key.split('.')
  c[section][name] = value
  _expect(c, *fragments, devices=1)


def test_clipping_can_be_turned_off_with_inf():
  c = tiny_config()
  c.optim.grad_clip_norm = float('inf')
  validate(c, 1)


def test_the_models_declare_their_own_keys():
  """The schema's model section is engine/config.py's shared keys and each model's own
  (MODEL_KEYS), every one with its default; a key no model reads is in neither."""
  schema = default_config().model
  for key in models.schema_keys():
    assert schema[key.name] == key.default and key.help.strip(), key
  llama_keys = {key.name for key in models.MODEL_KEYS['llama']}
  assert {'head_dim', 'rope_type', 'num_experts', 'moe_dispatch', 'hf_architecture'} <= llama_keys
  assert not llama_keys & {'name', 'num_layers', 'embed_dim', 'num_kv_heads', 'dtype', 'remat'}
  assert set(models.MODEL_CHECKS) <= set(models.MODEL_KEYS)


def test_a_model_check_is_a_config_error_with_the_same_line(monkeypatch):
  """A model's check raises the models' own error (models import nothing of the engine);
  validation reports it as a ConfigError, word for word, and only for that model."""
  def check(model, mesh):
    if model.num_layers % mesh['data']:
      raise ModelConfigError(f"model.num_layers={model.num_layers} over mesh.data={mesh['data']}.")

  monkeypatch.setitem(models.MODEL_CHECKS, 'gpt', check)
  c = tiny_config(mesh=(4, 1, 2))
  c.model.num_layers = 3
  with pytest.raises(ConfigError, match=r'^model.num_layers=3 over mesh.data=4.$'):
    validate(c, 8)
  c.model.num_layers = 4
  validate(c, 8)


@pytest.mark.parametrize('key, value', [('head_dim', 16), ('qk_norm', True),
                                        ('rope_type', 'linear'), ('num_experts', 4)])
def test_a_model_refuses_another_models_exclusive_key(key, value):
  c = tiny_config()
  c.model[key] = value
  _expect(c, f'model.{key}={value!r} is read by the llama model only; '
          "model.name='gpt' would ignore it: drop it.", devices=1)
  c.model.name = 'llama'
  validate(c, 1)  # The model that reads it.


def _experiment(name: str, arg=None):
  spec = importlib.util.spec_from_file_location(
      f'_{name}', os.path.join(ROOT, 'experiments', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def _flat(config) -> dict:
  return {f'{section}.{key}': value for section, keys in config.to_dict().items()
          for key, value in (keys.items() if isinstance(keys, dict) else [('', keys)])}


def test_the_pod_experiments_keep_only_their_numbers():
  """llama_8b.py and llama_70b.py are experiments/common.py's llama3_pod with their own sizes:
  they differ in those alone, and each is the model its docstring describes."""
  small, large = _flat(_experiment('llama_8b')), _flat(_experiment('llama_70b'))
  assert {key for key in small if small[key] != large[key]} == {
      'model.num_layers', 'model.embed_dim', 'model.num_heads', 'model.mlp_dim', 'model.max_len',
      'data.seq_len', 'data.global_batch_size', 'optim.learning_rate',
      'optim.end_learning_rate'}
  assert [small[k] for k in ('model.num_layers', 'model.embed_dim', 'model.num_heads',
                             'model.mlp_dim', 'data.seq_len', 'data.global_batch_size')] == [
      32, 4096, 32, 14336, 8192, 128]
  assert [large[k] for k in ('model.num_layers', 'model.embed_dim', 'model.num_heads',
                             'model.mlp_dim', 'data.seq_len', 'data.global_batch_size')] == [
      80, 8192, 64, 28672, 4096, 1024]
  assert (small['optim.learning_rate'], small['optim.end_learning_rate']) == (3e-4, 3e-5)
  assert (large['optim.learning_rate'], large['optim.end_learning_rate']) == (1.5e-4, 1.5e-5)
  assert small['model.num_kv_heads'] == 8 and small['model.rope_base'] == 500_000.0
  assert small['model.name'] == 'llama' and small['data.source'] == 'synthetic'
  arg = 'layers=4,seq=512,batch=16,microbatches=2,steps=5,mesh=2x2x2,mode=manual'
  custom = _flat(_experiment('llama_8b', arg))
  assert (custom['model.num_layers'], custom['model.max_len'], custom['data.seq_len'],
          custom['data.global_batch_size'], custom['train.microbatches'],
          custom['train.num_steps'], custom['optim.decay_steps'], custom['mesh.tensor'],
          custom['parallelism.mode']) == (4, 512, 512, 16, 2, 5, 5, 2, 'manual')
