"""A LoRA run from a Hugging Face checkpoint (a tiny Qwen2 written by the test; the adapters on
every projection, the rest frozen), exported merged and as a PEFT adapter: the merged export
loads back as a plain model whose logits are the run's, the PEFT tensors recombine (W + s B A,
in NumPy) into the merged weights, and peft's PeftModel on the base checkpoint (in the
reference environment: tests/support/reference_envs.py) computes the merged export's logits."""

import json
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from engine.assemble import lay_out
from engine.data.bpe_trainer import train as train_bpe
from engine.export.exporter import export_files
from engine.generate.sampling import load_run
from engine.hf import load as hf
from engine.errors import ConfigError
from engine.main import run as run_main
from engine.workdir.checkpoint import restore_params
from engine.models.ops import LocalOps
from tests.unit.test_hf_families import FAMILIES, _checkpoint
from tests.support.helpers import reference_python

pytestmark = pytest.mark.slow  # Trains.

TEXT = 'def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n' * 40
ALPHA, RANK = 16.0, 4


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp('lora')
  checkpoint = root / 'base'
  _checkpoint(checkpoint, dict(FAMILIES['qwen2'], vocab_size=320))
  train_bpe([TEXT], 300, str(checkpoint / 'tokenizer.json'))
  (root / 'train.txt').write_text(TEXT)
  code = run_main([
      f'--config={__file__.rsplit("/tests/", 1)[0]}/experiments/finetune_hf.py:hf={checkpoint},'
      'steps=3,mode=manual,mesh=2x2x2', f'--workdir={root / "run"}',
      f'--config.data.path={root / "train.txt"}', '--config.data.seq_len=16',
      '--config.data.global_batch_size=8', '--config.model.dtype=float32',
      f'--config.model.lora_rank={RANK}', f'--config.model.lora_alpha={ALPHA}',
      '--config.optim.learning_rate=0.01', '--config.optim.warmup_steps=0',
      '--config.train.eval_batches=1'])
  assert code == 0
  export_files(str(root / 'run'), str(root / 'merged'))
  export_files(str(root / 'run'), str(root / 'peft'), adapters_as='peft')
  return root


def _logits(params, setup, tokens):
  return jax.jit(lambda p: nnx.merge(setup.graphdef, p)(tokens, LocalOps()))(params)


def test_the_merged_export_computes_the_runs_logits(exported):
  run, params = load_run(str(exported / 'run'))
  tokens = np.asarray([run.tokenizer.encode(TEXT[:200])[:32]])
  adapted = _logits(params, run.setup, tokens)
  # The merged export, loaded as a plain model (no adapters) from its own files.
  config = run.config.copy_and_resolve_references()
  config.model.lora_rank = 0
  plain = lay_out(config, run.setup.model.vocab_size, jax.devices()[:1])
  merged = hf.load_params(str(exported / 'merged'), plain.abstract_state()['params'])
  np.testing.assert_allclose(_logits(merged, plain, tokens), adapted, atol=2e-5)
  # The adapters moved the model: the base checkpoint computes other logits.
  base = hf.load_params(str(exported / 'base'), plain.abstract_state()['params'])
  assert np.abs(_logits(base, plain, tokens) - adapted).max() > 1e-3


def test_the_peft_adapter_recombines_into_the_merged_weights(exported):
  adapter = load_file(str(exported / 'peft' / 'adapter_model.safetensors'))
  config = json.loads((exported / 'peft' / 'adapter_config.json').read_text())
  assert (config['peft_type'], config['r'], config['lora_alpha']) == ('LORA', RANK, ALPHA)
  assert sorted(config['target_modules']) == sorted(
      ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'])
  assert config['base_model_name_or_path'] == str(exported / 'base')
  base = load_file(str(exported / 'base' / 'model.safetensors'))
  merged = load_file(str(exported / 'merged' / 'model.safetensors'))
  modules = sorted({k.rsplit('.lora_', 1)[0] for k in adapter})
  assert len(modules) == 2 * 7  # Two layers, seven projections.
  for module in modules:
    name = module.removeprefix('base_model.model.') + '.weight'
    a, b = adapter[f'{module}.lora_A.weight'], adapter[f'{module}.lora_B.weight']
    assert a.shape == (RANK, base[name].shape[1]) and b.shape == (base[name].shape[0], RANK)
    np.testing.assert_allclose(base[name] + ALPHA / RANK * b.astype(np.float64) @ a,
                               merged[name], atol=1e-6, err_msg=name)
  # Everything else is the base checkpoint's, unchanged.
  for name in set(base) - {m.removeprefix('base_model.model.') + '.weight' for m in modules}:
    np.testing.assert_array_equal(merged[name], base[name], err_msg=name)


def test_peft_loads_the_adapter_onto_the_base_checkpoint(exported):
  python = reference_python()
  script = (
      'import sys, json, torch, transformers, peft\n'
      'base, merged, adapter = sys.argv[1:4]\n'
      'tokens = torch.tensor([list(range(3, 35))])\n'
      'load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)\n'
      'with torch.no_grad():\n'
      '  peft_logits = peft.PeftModel.from_pretrained(load(base), adapter)(tokens).logits\n'
      '  merged_logits = load(merged)(tokens).logits\n'
      '  base_logits = load(base)(tokens).logits\n'
      'print(json.dumps({"merged": (peft_logits - merged_logits).abs().max().item(),\n'
      '                  "base": (peft_logits - base_logits).abs().max().item()}))\n')
  proc = subprocess.run([python, '-c', script, str(exported / 'base'), str(exported / 'merged'),
                         str(exported / 'peft')], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  differences = json.loads(proc.stdout.strip().splitlines()[-1])
  assert differences['merged'] < 2e-5 < 1e-3 < differences['base'], differences


def test_a_lora_run_as_init_from_is_refused_rather_than_dropping_its_adapters(exported):
  run, _ = load_run(str(exported / 'run'))
  config = run.config.copy_and_resolve_references()
  config.model.lora_rank = 0
  plain = lay_out(config, run.setup.model.vocab_size, jax.devices()[:1])
  with pytest.raises(ConfigError, match=r"holds parameters this model does not have "
                     r"\(\['blocks'\]\['lora_\w+'\], \.\.\.\), which this run would drop; use the "
                     r'model config of that run, or for a run with adapters export it merged'):
    restore_params(str(exported / 'run'), plain.abstract_state()['params'])
