"""Hugging Face checkpoints as they come and as engine.export writes them.

In: every missing, extra, misshapen or non-float tensor is one ConfigError line from
engine.hf.load.load_params before any parameter is read; index files, buffers that are not weights
and tied heads load. Out: a trained run's export holds the config, generation config, weights
(in --dtype) and tokenizer files that transformers' Auto classes read.

The suite needs no transformers. With an environment that has torch and transformers, this
file checks the export against them (AutoTokenizer, AutoModelForCausalLM: the logits of the
engine's own forward pass) as a command:

  python -m tests.unit.test_hf_files --python=/path/to/env/bin/python
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from engine.hf import load as hf
from engine.hf import save as hf_save
from engine.assemble import lay_out
from engine.errors import ConfigError
from engine.data import tokenizers as tokenizer_lib
from engine.data.bpe_trainer import train as train_bpe
from engine.export.exporter import export, export_files
from engine.main import run as run_main
from tests.support.helpers import tiny_config

# ml_collections loads experiment files with a loader method Python deprecates (silent on the CLI).
pytestmark = pytest.mark.filterwarnings('ignore:the load_module.. method is deprecated')

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEGIN_OF_TEXT = '<|begin_of_text|>'

LAYERS = 4


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """A 4-layer grouped-query Llama's abstract parameters (one device) and the tensors and
  config.json engine.hf.save.save writes for random values of them."""
  config = tiny_config()
  config.model.name, config.model.num_layers, config.model.num_kv_heads = 'llama', LAYERS, 2
  abstract = lay_out(config, 256, jax.devices()[:1]).abstract_state()['params']
  rng = np.random.default_rng(0)
  host = {path: rng.standard_normal(leaf.shape).astype(np.float32)
          for path, leaf in hf.by_path(abstract).items()}
  out = tmp_path_factory.mktemp('export')
  hf_save.save(host, config.model, 256, str(out))
  with safe_open(str(out / 'model.safetensors'), framework='numpy') as f:
    tensors = {name: f.get_tensor(name) for name in f.keys()}
  return abstract, tensors, json.loads((out / 'config.json').read_text()), host


def _write(directory, tensors, config):
  directory.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(directory / 'model.safetensors'))
  (directory / 'config.json').write_text(json.dumps(config))
  return str(directory)


def _load(path, abstract, monkeypatch):
  """load_params, with reading any parameter an error: the checks come first."""
  def no_reads(*args):
    raise AssertionError('a parameter was read before the checks finished')
  with monkeypatch.context() as patch:
    patch.setattr(jax, 'make_array_from_callback', no_reads)
    return hf.load_params(path, abstract)


def _layer(i, name):
  return f'model.layers.{i}.{name}'


def _drop(*names):
  return lambda t: {k: v for k, v in t.items() if k not in names}


def _add(**extra):
  return lambda t: {**t, **{k.replace('__', '.'): v for k, v in extra.items()}}


def _more_layers(t):
  """Layers 4 and 5, copies of layer 0: a checkpoint deeper than its config.json says."""
  prefix = _layer(0, '')
  copies = {k.replace(prefix, _layer(i, '')): v for k, v in t.items() if k.startswith(prefix)
            for i in (4, 5)}
  return {**t, **copies}


def _renamed(t):
  return {k.replace('model.', 'language_model.model.'): v for k, v in t.items()}


def _int8(t):
  return {k: v.astype(np.int8) if 'mlp' in k else v for k, v in t.items()}


def _reshaped(t):
  return {**t, _layer(3, 'mlp.down_proj.weight'): t[_layer(3, 'mlp.down_proj.weight')][:, :32]}


W = "train.init_from=hf:{path}: "
BAD = [
    (_drop(_layer(2, 'mlp.up_proj.weight')),
     W + "tensor 'model.layers.2.mlp.up_proj.weight' is missing; the checkpoint is incomplete or "
     'its config.json names more layers than it holds.'),
    (_drop(*(_layer(3, n) for n in ('input_layernorm.weight', 'self_attn.q_proj.weight',
                                    'self_attn.k_proj.weight', 'self_attn.v_proj.weight',
                                    'self_attn.o_proj.weight', 'post_attention_layernorm.weight',
                                    'mlp.gate_proj.weight', 'mlp.up_proj.weight',
                                    'mlp.down_proj.weight'))),
     W + "9 tensors are missing, e.g. 'model.layers.3.input_layernorm.weight' (config.json says "
     'num_hidden_layers=4; the files hold layers 0..2); the checkpoint is incomplete or its '
     'config.json names more layers than it holds.'),
    (_more_layers,
     W + "18 tensors no parameter of the model reads, e.g. 'model.layers.4.input_layernorm.weight' "
     '(config.json says num_hidden_layers=4; the files hold layers 0..5): config.json names fewer '
     'layers than the checkpoint holds; give it the right num_hidden_layers.'),
    (_add(model__layers__1__self_attn__q_proj__bias=np.zeros(32, np.float32)),
     W + "tensor 'model.layers.1.self_attn.q_proj.bias' is not read by any parameter of the model: "
     'the weights hold parameters config.json does not describe (biases, norms: another '
     'architecture or variant); use the config.json the weights came with.'),
    (_renamed,
     W + "38 tensors are missing, e.g. 'model.embed_tokens.weight', and 38 tensors no parameter "
     "reads are there, e.g. 'language_model.model.embed_tokens.weight'; the files do not name "
     'their tensors as LlamaForCausalLM checkpoints do, or config.json describes another model '
     'than the weights.'),
    (_reshaped,
     W + "'model.layers.3.mlp.down_proj.weight' is (32, 32), the model needs (32, 64); the "
     'config.json and the weights disagree.'),
    (_int8,
     W + "12 tensors are not floating point, e.g. 'model.layers.0.mlp.gate_proj.weight' (I8); the "
     'engine reads floating-point weights (F32, BF16, F16, F64): load the unquantized '
     'checkpoint.'),
]


@pytest.mark.parametrize('change, message', BAD, ids=[
    'missing_in_layer_2', 'fewer_layers', 'more_layers', 'bias_not_in_model', 'renamed',
    'misshapen', 'int8'])
def test_bad_checkpoints_are_one_line_before_any_read(exported, tmp_path, monkeypatch, change,
                                                      message):
  abstract, tensors, config, _ = exported
  path = _write(tmp_path / 'hf', change(tensors), config)
  with pytest.raises(ConfigError) as error:
    _load(path, abstract, monkeypatch)
  assert str(error.value) == message.format(path=path)


def test_sharded_files_buffers_and_a_tied_head_load(exported, tmp_path, monkeypatch):
  abstract, tensors, config, host = exported
  # Two files and their index, and an old checkpoint's rotary buffers: they load, exactly.
  names = sorted(tensors)
  parts = {'model-00001-of-00002.safetensors': names[:20],
           'model-00002-of-00002.safetensors': names[20:]}
  directory = tmp_path / 'sharded'
  directory.mkdir()
  for file, part in parts.items():
    buffers = {_layer(i, 'self_attn.rotary_emb.inv_freq'): np.ones(4, np.float32)
               for i in range(LAYERS)} if file.startswith('model-00001') else {}
    save_file({n: tensors[n] for n in part} | buffers, str(directory / file))
  (directory / 'model.safetensors.index.json').write_text(json.dumps(
      {'weight_map': {n: f for f, part in parts.items() for n in part}}))
  (directory / 'config.json').write_text(json.dumps(config))
  params = hf.by_path(hf.load_params(str(directory), abstract))
  for path, value in host.items():
    np.testing.assert_array_equal(np.asarray(params[path]), value, err_msg=path)
  # The index naming a file that is not there.
  (directory / 'model-00002-of-00002.safetensors').unlink()
  with pytest.raises(ConfigError, match=r"names 1 file\(s\) not there, e.g. "
                     r"'model-00002-of-00002.safetensors'; the download is incomplete"):
    _load(str(directory), abstract, monkeypatch)
  # A tied checkpoint (tie_word_embeddings) reads the head from the embedding, also when the
  # files hold an lm_head (as transformers does).
  tied = _write(tmp_path / 'tied', tensors, dict(config, tie_word_embeddings=True))
  head = np.asarray(hf.by_path(hf.load_params(tied, abstract))['head_DV'])
  np.testing.assert_array_equal(head, tensors['model.embed_tokens.weight'].T)


def _train_run(directory: pathlib.Path) -> tuple[str, str]:
  """A tiny Llama trained 2 steps on README.md with a byte-level BPE tokenizer.json that has an
  end-of-text (0) and a beginning-of-text token (300); (workdir, tokenizer path)."""
  text = (ROOT / 'README.md').read_text()
  (directory / 'text.txt').write_text(text)
  tokenizer_path = str(directory / 'tokenizer.json')
  tokenizer = train_bpe([text], 300, tokenizer_path)
  tokenizer.add_special_tokens([BEGIN_OF_TEXT])
  tokenizer.save(tokenizer_path)
  workdir = str(directory / 'run')
  argv = ['--config=experiments/tiny.py', f'--workdir={workdir}', '--config.model.name=llama',
          '--config.model.num_layers=2', '--config.model.embed_dim=32', '--config.model.mlp_dim=64',
          '--config.model.num_kv_heads=2', '--config.data.seq_len=16', '--config.model.max_len=16',
          '--config.data.global_batch_size=8', '--config.train.num_steps=2',
          '--config.data.source=file', f'--config.data.path={directory / "text.txt"}',
          '--config.data.tokenizer=hf', f'--config.data.tokenizer_path={tokenizer_path}']
  assert run_main(argv) == 0
  return workdir, tokenizer_path


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  return _train_run(tmp_path_factory.mktemp('bpe_run'))


def _tensors(path):
  with safe_open(str(path / 'model.safetensors'), framework='numpy') as f:
    return {name: (f.get_slice(name).get_dtype(), f.get_tensor(name)) for name in f.keys()}


@pytest.mark.slow
def test_export_writes_config_generation_config_weights_and_tokenizer(trained, tmp_path):
  workdir, tokenizer_path = trained
  tokenizer = tokenizer_lib.load('hf', tokenizer_path)
  assert (tokenizer.bos_id, tokenizer.eos_id) == (300, 0)
  written = export_files(workdir, str(tmp_path / 'float32'))
  out = tmp_path / 'float32'
  assert written.files == ['config.json', 'generation_config.json', 'model.safetensors',
                           'tokenization_exported.py', 'tokenizer.json', 'tokenizer_config.json']
  # From the run's own copy (WORKDIR/tokenizer/), identical to the file it trained with.
  kept = os.path.join(workdir, 'tokenizer', 'tokenizer.json')
  assert written.tokenizer == (f'tokenizer.json, tokenizer_config.json '
                               f'(PreTrainedTokenizerFast) and tokenization_exported.py from '
                               f'{kept}.')
  assert open(kept, 'rb').read() == open(tokenizer_path, 'rb').read()
  config = json.loads((out / 'config.json').read_text())
  assert (config['bos_token_id'], config['eos_token_id']) == (300, 0)
  assert config['dtype'] == config['torch_dtype'] == 'float32'
  assert (config['max_position_embeddings'], config['vocab_size']) == (16, 320)
  assert json.loads((out / 'generation_config.json').read_text()) == {'bos_token_id': 300,
                                                                      'eos_token_id': 0}
  # The run's tokenizer.json, with a post-processor that puts the beginning-of-text id first
  # (transformers adds special tokens by default; the engine encodes without, then adds it).
  exported = json.loads((out / 'tokenizer.json').read_text())
  source = json.loads(pathlib.Path(tokenizer_path).read_text())
  assert source['post_processor'] is None
  assert exported['post_processor']['type'] == 'TemplateProcessing'
  assert {**exported, 'post_processor': None} == source
  import tokenizers  # pylint: disable=g-import-not-at-top
  assert tokenizers.Tokenizer.from_file(str(out / 'tokenizer.json')).encode('to be').ids == [
      300, *tokenizer.encode('to be').tolist()]
  # The class that loads tokenizer.json whole, whatever the model type (auto_map: see
  # engine/hf/save.py).
  assert json.loads((out / 'tokenizer_config.json').read_text()) == {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'auto_map': {'AutoTokenizer': [None, 'tokenization_exported.ExportedTokenizer']},
      'bos_token': BEGIN_OF_TEXT,
      'eos_token': '<|endoftext|>', 'model_max_length': 16}
  assert 'class ExportedTokenizer(PreTrainedTokenizerFast):' in (
      out / 'tokenization_exported.py').read_text()
  # --dtype: the float32 weights rounded, in safetensors' BF16 / F16; config.json says which.
  full = _tensors(out)
  assert {dtype for dtype, _ in full.values()} == {'F32'} and len(full) == 21
  for dtype, code in (('bfloat16', 'BF16'), ('float16', 'F16')):
    assert len(export(workdir, str(tmp_path / dtype), dtype)) == 21
    for name, (stored, value) in _tensors(tmp_path / dtype).items():
      assert stored == code, name
      np.testing.assert_array_equal(value, full[name][1].astype(hf_save.DTYPES[dtype]), err_msg=name)
    assert json.loads((tmp_path / dtype / 'config.json').read_text())['dtype'] == dtype
  with pytest.raises(ConfigError, match=r"--dtype=float16: 'w' holds values up to 100000, beyond "
                     r"float16's range; export --dtype=bfloat16 or float32\."):
    hf_save._cast('w', np.array([1e5], np.float32), 'float16')  # pylint: disable=protected-access


@pytest.mark.slow
def test_sentencepiece_tokenizer_files_and_none_for_bytes(tmp_path):
  import sentencepiece  # pylint: disable=g-import-not-at-top
  sentencepiece.SentencePieceTrainer.train(
      input=str(ROOT / 'README.md'), model_prefix=str(tmp_path / 'sp'), vocab_size=100,
      model_type='bpe', minloglevel=2)
  sp = tokenizer_lib.load('sentencepiece', str(tmp_path / 'sp.model'))
  out = tmp_path / 'sp_out'
  out.mkdir()
  assert hf_save.save_tokenizer(sp, str(out), 16) == (
      'tokenizer.model, tokenizer_config.json (SentencePieceBackend) and tokenization_exported.py '
      f'from {tmp_path / "sp.model"}.')
  assert sorted(os.listdir(out)) == ['tokenization_exported.py', 'tokenizer.model',
                                     'tokenizer_config.json']
  # The sentencepiece library itself (not LlamaTokenizer's byte-fallback BPE rebuilt from the
  # vocabulary), the beginning-of-text id first, as the engine's data and prompts start.
  assert json.loads((out / 'tokenizer_config.json').read_text()) == {
      'tokenizer_class': 'SentencePieceBackend',
      'auto_map': {'AutoTokenizer': [None,
                                     'tokenization_exported.ExportedSentencePieceTokenizer']},
      'add_bos_token': True, 'add_eos_token': False, 'special_tokens_pattern': 'bos',
      'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>', 'model_max_length': 16}
  none = tmp_path / 'byte_out'
  none.mkdir()
  assert hf_save.save_tokenizer(tokenizer_lib.ByteTokenizer(), str(none), 16) == (
      'no tokenizer files: data.tokenizer=byte (ids are UTF-8 bytes) has no Hugging Face '
      'tokenizer file.')
  assert not os.listdir(none)


# Runs in the environment with transformers: loads an export with the Auto classes; prints JSON.
TRANSFORMERS_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
out, text, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(out)
model = AutoModelForCausalLM.from_pretrained(out)
generation = GenerationConfig.from_pretrained(out)
with torch.no_grad():
  logits = model(torch.tensor([ids])).logits[0].float()
  generated = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
print(json.dumps({
    'classes': [type(tokenizer).__name__, type(model).__name__], 'dtype': str(model.dtype),
    'ids': tokenizer(text)['input_ids'], 'decoded': tokenizer.decode(ids[1:]),
    'bos': [model.config.bos_token_id, generation.bos_token_id, tokenizer.bos_token_id],
    'eos': [model.config.eos_token_id, generation.eos_token_id, tokenizer.eos_token_id],
    'logits': logits.tolist(), 'generated': generated[0, len(ids):].tolist()}))
"""


def transformers_check(python: str) -> bool:
  """Exports a trained run (float32, bfloat16) and loads each export with `python`'s
  transformers: the tokenizer's ids and the model's logits against the engine's. Prints what it
  compared; True if everything agrees."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from engine.generate.sampling import load_run  # pylint: disable=g-import-not-at-top
  ok = True
  with tempfile.TemporaryDirectory() as tmp:
    workdir, tokenizer_path = _train_run(pathlib.Path(tmp))
    absl_logging.set_verbosity(absl_logging.ERROR)  # Orbax's warnings on restoring.
    tokenizer = tokenizer_lib.load('hf', tokenizer_path)
    text = 'Hugging Face checkpoints in and out'
    ids = [tokenizer.bos_id, *tokenizer.encode(text).tolist()]
    run, params = load_run(workdir)
    engine_logits = np.asarray(nnx.merge(run.setup.graphdef, params)(np.array([ids], np.int32)))[0]
    for dtype, atol in (('float32', 1e-4), ('bfloat16', 0.1)):
      out = os.path.join(tmp, dtype)
      written = export_files(workdir, out, dtype)
      print(f'{dtype}: {", ".join(written.files)}')
      proc = subprocess.run([python, '-c', TRANSFORMERS_SCRIPT, out, text, json.dumps(ids)],
                            capture_output=True, text=True, timeout=600)
      if proc.returncode:
        print(proc.stderr[-3000:])
        return False
      warnings = [line for line in proc.stderr.splitlines() if 'warn' in line.lower()]
      got = json.loads(proc.stdout.strip().splitlines()[-1])
      diff = float(np.abs(np.asarray(got['logits']) - engine_logits).max())
      checks = {'AutoTokenizer ids == engine ids (BOS first)': got['ids'] == ids,
                'decoded == text': got['decoded'] == text,
                'bos ids (config, generation config, tokenizer) == 300':
                    got['bos'] == [tokenizer.bos_id] * 3,
                'eos ids == 0': got['eos'] == [tokenizer.eos_id] * 3,
                f'max |logits - engine logits| = {diff:.2e} <= {atol}': diff <= atol}
      print(f'  {got["classes"]}, {got["dtype"]}, ids {got["ids"]}, greedy {got["generated"]}')
      for what, good in checks.items():
        print(f'  {"ok  " if good else "FAIL"} {what}')
        ok &= good
      for line in warnings:
        print(f'  warning: {line}')
  return ok


if __name__ == '__main__':
  PYTHON = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--python=')), None)
  if not PYTHON:
    sys.exit('usage: python -m tests.unit.test_hf_files --python=ENV/bin/python '
             '(torch, transformers)')
  sys.exit(0 if transformers_check(PYTHON) else 1)


@pytest.mark.parametrize('name', ['../outside.safetensors', '/etc/passwd', 'sub/../../x'])
def test_an_index_naming_a_file_outside_its_directory_is_refused(exported, tmp_path, monkeypatch,
                                                                  name):
  abstract, tensors, config, _ = exported
  directory = pathlib.Path(_write(tmp_path / 'hf', tensors, config))
  save_file({'x': np.zeros(1, np.float32)}, str(tmp_path / 'outside.safetensors'))
  (directory / 'model.safetensors.index.json').write_text(json.dumps(
      {'weight_map': {'model.norm.weight': name}}))
  with pytest.raises(ConfigError, match=rf"model.safetensors.index.json names {re.escape(repr(name))}"
                     r", which (is not a file name inside|resolves outside)"):
    _load(str(directory), abstract, monkeypatch)


@pytest.mark.slow
def test_export_replaces_an_earlier_export_whole_and_refuses_other_directories(trained,
                                                                               tmp_path):
  workdir, _ = trained
  out = tmp_path / 'out'
  out.mkdir()
  # An earlier, sharded checkpoint there: its index would outlive a plain write and be loaded.
  (out / 'model.safetensors.index.json').write_text('{"weight_map": {}}')
  (out / 'model-00001-of-00002.safetensors').write_bytes(b'old')
  written = export_files(workdir, str(out))
  assert written.files == sorted(p.name for p in out.iterdir()) == [
      'config.json', 'generation_config.json', 'model.safetensors', 'tokenization_exported.py',
      'tokenizer.json', 'tokenizer_config.json']
  assert not list(tmp_path.glob('out.*'))  # No staging or replaced copy left beside it.
  # A directory holding anything else is refused, untouched.
  other = tmp_path / 'notes'
  other.mkdir()
  (other / 'todo.txt').write_text('keep me')
  with pytest.raises(ConfigError, match=r"--out=.*notes holds 1 entries that are not a Hugging "
                     r"Face checkpoint's, e.g. 'todo.txt'; pass a new or empty directory"):
    export_files(workdir, str(other))
  assert [p.name for p in other.iterdir()] == ['todo.txt']
