"""`python -m engine.analysis.hf_check`'s engine side, without torch: the NumPy Llama of
tests/unit/test_hf.py stands in for transformers (the checkpoint's logits, and the logits of the
engine's export). The run against transformers itself needs a Python with torch and
transformers; see the module's docstring."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.analysis.hf_check import checker as hf_checker
from engine.analysis.hf_check import engine_side as hf_compare
from engine.errors import ConfigError
from tests.unit.test_hf import HF_CONFIG, _random_checkpoint, _reference_logits

MODES = ('auto', 'manual')


def _numpy_transformers(directory: str, tokens_BL: np.ndarray):
  """What the child returns for an export: logits of the checkpoint in `directory`, warnings."""
  with open(os.path.join(directory, 'config.json')) as f:
    config = json.load(f)
  tensors = load_file(os.path.join(directory, 'model.safetensors'))
  return _reference_logits(tensors, config, tokens_BL), []


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
  """A random Llama checkpoint, its fixed tokens and the reference logits of their inputs."""
  path = tmp_path_factory.mktemp('hf_check') / 'llama2'
  tensors, config = _random_checkpoint(path)
  tokens = hf_compare.make_tokens(vocab=config['vocab_size'])
  return str(path), tokens, _reference_logits(tensors, config, tokens[:, :-1])


@pytest.fixture(scope='module')
def measured(checkpoint):
  """The engine's side in both modes on 2x2x2 (each compiled once for the whole module)."""
  path, tokens, _ = checkpoint
  return {mode: hf_compare.measure(path, mode, tokens, f'{path}_{mode}_export', '2x2x2')
          for mode in MODES}


def _measure_as(measured):
  """hf_compare.measure, answered from the module's runs: their exports copied where asked."""

  def measure(path, mode, tokens, export_dir, mesh='2x2x2'):
    del path, tokens, mesh
    shutil.copytree(measured[mode].export_dir, export_dir)
    return dataclasses.replace(measured[mode], export_dir=export_dir)

  return measure


def _row(checkpoint, measured, mode, reference=None, export=None, warnings=()):
  path, tokens, reference_logits = checkpoint
  export_logits, _ = _numpy_transformers(measured[mode].export_dir, tokens[:, :-1])
  return hf_compare.compare('llama2', 'v5', measured[mode],
                          reference_logits if reference is None else reference, tokens,
                          export_logits if export is None else export, list(warnings))


@pytest.mark.slow
@pytest.mark.parametrize('mode', MODES)
def test_both_modes_match_the_reference_and_their_export(checkpoint, measured, mode):
  row = _row(checkpoint, measured, mode)
  assert row['verdict'] == 'PASS', row['failed']
  assert row['status'] == 'ok' and not row['load_warnings']
  if mode == 'auto':
    assert row['logits_max_diff'] < 1e-5
  else:
    assert row['logits_max_diff'] is None  # Manual mode is checked through its losses.
  assert row['eval_loss_diff'] < 1e-5 and row['train_loss_diff'] < 1e-5
  assert row['export_logits_max_diff'] < 1e-5 and row['export_eval_loss_diff'] < 1e-5
  # The step moved the parameters: the export is of the trained model, not the loaded one.
  assert abs(row['export_reference_loss'] - row['reference_loss']) > 1e-3
  assert row['model']['hf_architecture'] == 'LlamaForCausalLM'
  json.dumps(row)  # The row goes to OUT.json as it is.


@pytest.mark.slow
def test_a_perturbed_reference_fails(checkpoint, measured):
  _, tokens, reference = checkpoint
  off = reference.copy()
  off[0] *= 1.05  # One row's logits 5 % off.
  auto = _row(checkpoint, measured, 'auto', reference=off)
  assert auto['verdict'] == 'FAIL'
  assert {'logits', 'eval loss', 'train-step loss'} <= set(auto['failed'])
  assert 'export logits' not in auto['failed']
  manual = _row(checkpoint, measured, 'manual', reference=off)  # Seen by the loss alone.
  assert manual['verdict'] == 'FAIL' and 'eval loss' in manual['failed']
  # The export side: transformers' logits of the export, or a warning while loading it.
  export, _ = _numpy_transformers(measured['manual'].export_dir, tokens[:, :-1])
  export[1, 5, 7] += 0.01
  row = _row(checkpoint, measured, 'manual', export=export)
  assert row['failed'] == ['export logits']  # Too small a change for the loss to show.
  row = _row(checkpoint, measured, 'auto', warnings=['WARNING: lm_head.weight MISSING'])
  assert row['failed'] == ['load warnings']
  table = hf_checker.markdown([row], 'check')
  assert 'FAIL (load warnings)' in table and '1: WARNING: lm_head.weight MISSING' in table


@pytest.mark.slow
def test_check_runs_measure_reload_compare(checkpoint, measured, monkeypatch, tmp_path):
  path, tokens, reference = checkpoint
  monkeypatch.setattr(hf_compare, 'measure', _measure_as(measured))
  reloaded = []

  def reload(directory):
    reloaded.append(directory)
    return _numpy_transformers(directory, tokens[:, :-1])

  export_dir = str(tmp_path / 'export')
  row = hf_compare.check('llama2', 'legacy', path, 'auto', tokens, reference, reload, export_dir)
  assert (row['format'], row['verdict'], reloaded) == ('legacy', 'PASS', [export_dir])


def test_a_checkpoint_the_engine_refuses_is_a_row(tmp_path):
  path = tmp_path / 'yarn'
  path.mkdir()
  (path / 'config.json').write_text(json.dumps(dict(
      HF_CONFIG, rope_scaling={'rope_type': 'yarn', 'factor': 4.0})))
  tokens = hf_compare.make_tokens()
  row = hf_compare.check('llama3', 'legacy', str(path), 'manual', tokens, None,
                       lambda d: pytest.fail('nothing to reload'), str(tmp_path / 'export'))
  assert row['verdict'] == 'REFUSED'
  assert row['status'].startswith('refused: ') and "rope_type='yarn'" in row['status']
  table = hf_checker.markdown([row], 'check')
  assert "| llama3 | legacy | manual | refused: " in table and table.endswith('| REFUSED |')


class _FakeChild:
  """The child's protocol, answered with the NumPy Llama (and one family that fails)."""

  def __init__(self, tmp_path, checkpoint):
    self.tmp_path, self.checkpoint = tmp_path, checkpoint

  def make(self, family, directory, formats, tokens_BL):
    if family == 'qwen3':
      raise RuntimeError('hf_reference.py make: ValueError: no such model')
    path, tokens, reference = self.checkpoint
    np.testing.assert_array_equal(tokens_BL, tokens[:, :-1])
    formats_reply = {}
    for fmt in formats:
      out = self.tmp_path / family / fmt
      out.mkdir(parents=True)
      np.save(out / 'reference_logits.npy', reference.astype(np.float32))
      formats_reply[fmt] = {'dir': str(out), 'warnings': []}
    return {'formats': formats_reply}

  def logits(self, directory, tokens_BL):
    return _numpy_transformers(directory, tokens_BL)


@pytest.mark.slow
def test_run_checks_gives_every_row(checkpoint, measured, monkeypatch, tmp_path):
  monkeypatch.setattr(hf_compare, 'measure', _measure_as(measured))
  rows, made = hf_checker.run_checks(_FakeChild(tmp_path, checkpoint), ['llama2', 'qwen3'],
                                     ['v5', 'legacy'], list(MODES), '2x2x2', str(tmp_path))
  assert [(r['family'], r['format'], r['mode'], r['verdict']) for r in rows] == [
      ('llama2', 'v5', 'auto', 'PASS'), ('llama2', 'v5', 'manual', 'PASS'),
      ('llama2', 'legacy', 'auto', 'PASS'), ('llama2', 'legacy', 'manual', 'PASS'),
      ('qwen3', 'v5', 'auto', 'ERROR'), ('qwen3', 'v5', 'manual', 'ERROR'),
      ('qwen3', 'legacy', 'auto', 'ERROR'), ('qwen3', 'legacy', 'manual', 'ERROR')]
  assert set(made) == {'llama2'} and 'no such model' in rows[-1]['status']
  table = hf_checker.markdown(rows, 'title').splitlines()
  assert len(table) == 6 + len(rows) and table[6].startswith('| llama2 | v5 | auto | ')


def test_bad_lists_and_a_python_without_torch_are_config_errors(tmp_path):
  assert hf_checker.chosen(['qwen2', ' llama3'], hf_checker.FAMILIES, '--families') == [
      'qwen2', 'llama3']
  with pytest.raises(ConfigError, match=r"--families: 'gemma' is unknown; choose from llama2,"):
    hf_checker.chosen(['llama2', 'gemma'], hf_checker.FAMILIES, '--families')
  with pytest.raises(ConfigError, match='--formats is empty'):
    hf_checker.chosen([], hf_checker.FORMATS, '--formats')
  with pytest.raises(ConfigError, match='cannot run it'):
    hf_checker.check_torch_python(str(tmp_path / 'no-python'))
  fake = tmp_path / 'python'  # A "Python" whose imports fail, as one without torch.
  fake.write_text('#!/bin/sh\necho "ModuleNotFoundError: No module named \'torch\'" >&2\n'
                  'exit 1\n')
  fake.chmod(0o755)
  with pytest.raises(ConfigError, match=r"cannot import torch.*No module named 'torch'"):
    hf_checker.check_torch_python(str(fake))


def test_the_command_reports_bad_flags_in_one_line():
  done = subprocess.run([sys.executable, '-m', 'engine.analysis.hf_check',
                         '--torch_python=/nonexistent/python', '--families=llama2,gemma9'],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  lines = [l for l in done.stderr.splitlines() if l.strip()]
  assert lines == ["error: --families: 'gemma9' is unknown; choose from llama2,llama3,mistral,"
                   "qwen2,qwen3,mixtral,qwen3_moe,deepseek_v3,gemma2,gemma3."], done.stderr


def test_the_reference_loss_is_optax_cross_entropy(checkpoint):
  import optax  # pylint: disable=g-import-not-at-top
  _, tokens, reference = checkpoint
  expected = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      reference, tokens[:, 1:])).mean()
  assert hf_compare.next_token_loss(reference, tokens) == pytest.approx(float(expected), abs=1e-6)
