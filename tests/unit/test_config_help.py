"""Finding one's way in the config: the help on every key, `--print_config`, and the key a
misspelt or abbreviated override most likely meant (the full messages:
tests/support/bad_inputs_main.py)."""

import ast
import os

import jax
import pytest
from ml_collections import ConfigDict

from engine import config as config_lib
from engine import models
from engine.cli import config_help
from engine import main as engine_main
from tests.support.bad_input_checks import ROOT

pytestmark = pytest.mark.filterwarnings('ignore:the load_module.. method is deprecated')


def _schema_keys() -> list[str]:
  """default_config()'s keys in the order the source assigns them, read with ast (not the code
  under test): every `c.key = ...` and `c.section.key = ...` that is not a section, and the
  models' own keys where the loop over models.schema_keys() merges them."""
  tree = ast.parse(open(os.path.join(ROOT, 'engine', 'config.py')).read())
  function = next(n for n in tree.body if getattr(n, 'name', '') == 'default_config')
  keys = []
  for n in function.body:
    if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]).startswith('c.'):
      keys.append(ast.unparse(n.targets[0]).removeprefix('c.'))
    elif isinstance(n, ast.For) and ast.unparse(n.iter) == 'models.schema_keys()':
      keys += [f'model.{key.name}' for key in models.schema_keys()]
  return [key for key in keys if not any(other.startswith(key + '.') for other in keys)]


def test_every_key_has_a_line_of_help():
  keys, helps = _schema_keys(), config_help.key_help()
  assert len(keys) > 60 and keys[0] == 'seed' and keys[-1] == 'train.wandb_mode'
  assert set(keys) == {k for k, v in config_lib.flat_defaults().items()
                       if not isinstance(v, ConfigDict)}
  missing = [key for key in keys if not helps.get(key, '').strip()]
  assert not missing, f'keys without a comment in engine/config.py default_config(): {missing}'
  # A comment above the key and one after it are joined; a comment is no other key's.
  assert helps['model.max_len'] == 'Learned position embeddings cover this many positions.'
  assert helps['parallelism.grad_reduce_dtype'] == (
      'Manual mode: dtype of the gradient reductions and of the FSDP gathers they transpose. '
      'float32 | bfloat16')
  assert helps['model.vocab_size'].startswith("-1: the tokenizer's vocabulary, rounded up")
  assert helps['model.num_layers'] == 'Transformer blocks.'


@pytest.mark.parametrize('typed, meant', [
    ('optim.lr', ['optim.learning_rate']),
    ('lr', ['model.lora_rank', 'optim.learning_rate']),  # Both abbreviate to l_r.
    ('optim.wd', ['optim.weight_decay']), ('bs', ['data.global_batch_size']),
    ('batch_size', ['data.global_batch_size']), ('data.bs', ['data.global_batch_size']),
    ('steps', ['train.num_steps']), ('train.steps', ['train.num_steps']),
    ('layers', ['model.num_layers']), ('model.heads', ['model.num_heads']),
    ('train.learning_rate', ['optim.learning_rate']), ('model.seq_len', ['data.seq_len']),
    ('optimizer.b2', ['optim.b2']), ('optm.b2', ['optim.b2']),
    ('model.num_layerz', ['model.num_layers']), ('train.lernin_rate', ['optim.learning_rate']),
    ('optim.steps', ['optim.warmup_steps', 'optim.decay_steps']),
    # Nothing close: no suggestion rather than a wild one.
    ('mesh.foo', []), ('model.bogus', []), ('model.x', []), ('foo', [])])
def test_the_key_meant(typed, meant):
  assert config_help.suggest(typed) == meant


@pytest.fixture
def compiles():
  seen = []

  def listener(event: str, seconds: float, **kwargs) -> None:
    if event == '/jax/core/compile/backend_compile_duration':
      seen.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(listener)
  yield seen
  jax.monitoring.unregister_event_duration_listener(listener)


def _values(out: str) -> dict[str, str]:
  """`key = value  # help` lines -> key -> value as printed."""
  lines = [line for line in out.splitlines() if line]
  assert all(' = ' in line and '  # ' in line for line in lines), out
  return {line.split(' = ')[0]: line.split(' = ', 1)[1].split('  # ')[0] for line in lines}


def test_print_config_lists_every_key_with_the_run_values(tmp_path, capfd, monkeypatch,
                                                          compiles):
  monkeypatch.chdir(ROOT)
  workdir = tmp_path / 'run'
  for argv in (['--config=experiments/tiny.py:steps=7', '--config.model.num_layers=3',
                "--config.train.sample_prompt=a b.txt", '--print_config'],
               ['--config=experiments/tiny.py:steps=7', '--print_config',
                '--config.model.num_layers=3', '--config.train.sample_prompt=a b.txt',
                f'--workdir={workdir}']):
    assert engine_main.run(argv) == 0
    out, err = capfd.readouterr()
    assert not err, err
    values = _values(out)
    assert list(values) == _schema_keys()  # Every key once, in the source's order.
    assert values['model.num_layers'] == '3'  # An override.
    assert values['train.num_steps'] == '7'  # The experiment argument.
    assert values['train.sample_prompt'] == "'a b.txt'"  # A value with a space, quoted.
    assert values['optim.b2'] == '0.99'  # A default.
    assert 'optim.learning_rate = 0.001  # Peak learning rate' in out
    # Sections apart: a blank line before each section's first key, none within one.
    blocks = out.strip().split('\n\n')
    assert [block.split(' = ')[0].partition('.')[0] for block in blocks] == [
        'seed', 'model', 'data', 'optim', 'mesh', 'parallelism', 'train']
  assert not workdir.exists() and not os.listdir(tmp_path)
  assert not compiles, f'{len(compiles)} XLA compiles'


def test_print_config_refuses_an_experiment_key_the_schema_lacks(tmp_path, capfd, monkeypatch):
  monkeypatch.chdir(ROOT)
  experiment = tmp_path / 'typo.py'
  experiment.write_text('from engine.config import default_config\n\n\n'
                        'def get_config(arg=None):\n  config = default_config()\n'
                        '  config.optim.lr = 1.0\n  return config\n')
  assert engine_main.run([f'--config={experiment}', '--print_config']) == 2
  out, err = capfd.readouterr()
  assert not out
  assert err == ("error: Unknown config keys ['optim.lr'] (did you mean optim.learning_rate?); "
                 'see engine/config.py default_config() for the schema (a typo in an '
                 'override?).\n')


def test_print_config_lists_then_refuses_a_value_the_run_would_refuse(tmp_path, capfd,
                                                                      monkeypatch, compiles):
  monkeypatch.chdir(ROOT)
  for argv, line in (
      (['--config.optim.b2=1.5'], 'optim.b2=1.5 must lie in [0, 1)'),
      # A data file that is not there: the run's check looks for it too.
      (['--config.data.source=file', f'--config.data.path={tmp_path}/gone.txt'],
       f"data.path='{tmp_path}/gone.txt' does not exist")):
    assert engine_main.run(['--config=experiments/tiny.py', *argv, '--print_config']) == 2
    out, err = capfd.readouterr()
    assert list(_values(out)) == _schema_keys()  # The listing, whole,
    assert err.startswith(f'error: {line}') and err.count('\n') == 1, err  # then one line.
  assert not os.listdir(tmp_path)
  assert not compiles, f'{len(compiles)} XLA compiles'
