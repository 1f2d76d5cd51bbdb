"""experiments/finetune_hf.py as its docstring runs it: a downloaded Hugging Face checkpoint (here
a tiny Qwen2 with its tokenizer.json, written by the test) fine-tuned on a text file, evaluated,
and exported with its tokenizer."""

import json

import numpy as np
import pytest

from engine.data.bpe_trainer import train as train_bpe
from engine.evaluate.scoring import evaluate
from engine.export.exporter import export_files
from engine.generate.sampling import load_run
from engine.main import run as run_main
from tests.unit.test_hf_families import FAMILIES, _checkpoint

pytestmark = pytest.mark.slow  # Every test here trains, compiles large or starts processes.

TEXT = 'def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n' * 40


def test_finetune_evaluate_export(tmp_path, monkeypatch):
  checkpoint = tmp_path / 'Qwen-tiny'
  _checkpoint(checkpoint, dict(FAMILIES['qwen2'], vocab_size=320))
  train_bpe([TEXT], 300, str(checkpoint / 'tokenizer.json'))
  (tmp_path / 'train.txt').write_text(TEXT)
  workdir = tmp_path / 'run'
  monkeypatch.chdir(tmp_path.parent)  # Paths as a user gives them; the experiment by its path.
  code = run_main([
      f'--config={__file__.rsplit("/tests/", 1)[0]}/experiments/finetune_hf.py:hf={checkpoint},'
      'steps=2', f'--workdir={workdir}', f'--config.data.path={tmp_path / "train.txt"}',
      '--config.data.seq_len=16', '--config.data.global_batch_size=8',
      '--config.model.dtype=float32', '--config.train.eval_batches=1'])
  assert code == 0
  saved = json.loads((workdir / 'config.json').read_text())
  assert saved['model']['hf_architecture'] == 'Qwen2ForCausalLM' and saved['model']['qkv_bias']
  # Evaluate with the checkpoint's own tokenizer, BOS first when it has one.
  run, params = load_run(str(workdir))
  assert run.tokenizer.kind == 'hf' and run.setup.model.vocab_size == 320
  result = evaluate(run.setup, params, run.tokenizer.encode(TEXT), 16, batch=4)
  assert np.isfinite(result['loss']) and result['windows'] > 1
  # Export: weights, config, generation config and the tokenizer.
  exported = export_files(str(workdir), str(tmp_path / 'out'))
  files = sorted(p.name for p in (tmp_path / 'out').iterdir())
  assert {'config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json',
          'tokenizer_config.json'} <= set(files), files
  config = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert config['architectures'] == ['Qwen2ForCausalLM'] and config['vocab_size'] == 320
  assert 'model.layers.1.self_attn.q_proj.bias' in exported.tensors
  assert (tmp_path / 'out' / 'tokenizer.json').read_bytes() == (
      checkpoint / 'tokenizer.json').read_bytes()
