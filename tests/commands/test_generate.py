"""engine.generate and engine.evaluate: the cached decode against recomputing the whole forward
pass, compilations, sharded parameters and cache, sampling, and the command lines."""

import concurrent.futures
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from engine.config import default_config

from engine.errors import ConfigError
from engine.data import tokenizers as tokenizer_lib
from engine.evaluate.scoring import evaluate
from engine.data.prompts import encode_prompts
from engine.generate.sampling import (Generator, Sampling, load_run, prompts_and_slots,
                                      resolve_new_tokens)
from engine.main import run as run_main
from engine.assemble import lay_out
from tests.support.helpers import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [np.array([5, 17, 99, 3]), np.array([42]), np.array([7, 8, 9, 10, 11, 12, 13, 14, 15])]
NEW = 10


def _setup(model, mesh=(1, 1, 1)):
  config = tiny_config(mesh=mesh)
  config.model.name, config.model.max_len = model, 32
  if model == 'llama':
    config.model.num_kv_heads = 2  # Grouped-query: two query heads per key / value head.
  size = int(np.prod(mesh))
  return lay_out(config, 256, jax.devices()[:size])


@pytest.fixture(scope='module', params=['gpt', 'llama'])
def model_and_params(request):
  train_setup = _setup(request.param)
  state, _ = train_setup.init(0)
  return request.param, train_setup, state['params']


def _recomputed(train_setup, params, prompt, steps):
  """Greedy decoding by running the whole forward pass again for every new token (on the
  sequence so far, padded to a fixed length: causal attention ignores what follows)."""
  forward = jax.jit(lambda p, t: nnx.merge(train_setup.graphdef, p)(t))
  tokens = list(prompt)
  for _ in range(steps):
    padded = np.zeros((1, 32), np.int32)
    padded[0, :len(tokens)] = tokens
    tokens.append(int(np.argmax(forward(params, padded)[0, len(tokens) - 1])))
  return tokens[len(prompt):]


@pytest.mark.slow
def test_cached_greedy_equals_recomputing_and_compiles_once(model_and_params):
  _, train_setup, params = model_and_params
  generator = Generator(train_setup, 16, NEW)
  outputs = generator.generate(params, PROMPTS, NEW)
  for prompt, out in zip(PROMPTS, outputs):
    assert list(out) == _recomputed(train_setup, params, prompt, NEW)
  # Other prompt lengths and counts of new tokens: nothing compiles again.
  generator.generate(params, [np.array([1, 2]), np.array([3] * 16), np.array([9])], NEW - 3)
  assert generator.prefill._cache_size() == 1 and generator.decode._cache_size() == 1


@pytest.mark.slow
@pytest.mark.parametrize('mesh', [(2, 1, 4), (4, 1, 2), (1, 8, 1)],
                         ids=['data2_tensor4', 'data4_tensor2', 'fsdp8'])
def test_sharded_generation_matches_one_device(model_and_params, mesh):
  model, one_device, params = model_and_params
  expected = Generator(one_device, 16, NEW).generate(params, PROMPTS, NEW)
  train_setup = _setup(model, mesh)
  sharded = jax.device_put(params, train_setup.state_shardings()['params'])
  generator = Generator(train_setup, 16, NEW)
  for got, want in zip(generator.generate(sharded, PROMPTS, NEW), expected):
    np.testing.assert_array_equal(got, want)
  tokens = np.zeros((8, 16), np.int32)
  cache, _ = generator.prefill(sharded, tokens, np.ones(8, np.int32), jax.random.key(0))
  # [layers, batch, slots, kv heads, head_dim]: Llama caches its 2 key / value heads, not its 4
  # query heads; heads split over tensor where they divide (Llama's 2 over tensor 4 do not).
  heads = 2 if model == 'llama' else 4
  assert cache['k'].shape == (2, 8, 16 + NEW, heads, 8)
  assert cache['k'].sharding.spec[3] == (
      'tensor' if mesh[2] > 1 and heads % mesh[2] == 0 else None)
  assert generator.cache_bytes(8) == 2 * cache['k'].nbytes  # What the log line reports,
  assert train_setup.attention_heads() == {'query': 4, 'kv': heads}  # and its cut, 4 / heads.


def _latent_setup(mesh=(1, 1, 1), dense_layers=0):
  """A Llama with latent attention; with `dense_layers`, DeepSeek-V3's: that many dense layers,
  then 2 mixtures of experts."""
  config = tiny_config(mesh=mesh)
  config.model.name, config.model.max_len = 'llama', 32
  config.model.update(mla_kv_rank=12, mla_q_rank=10, mla_rope_dim=4, head_dim=8, mla_value_dim=6)
  if dense_layers:
    config.model.update(num_experts=4, moe_mlp_dim=16, moe_router='sigmoid_topk', moe_groups=2,
                        moe_dense_layers=dense_layers, num_layers=2 + dense_layers)
  return lay_out(config, 256, jax.devices()[:int(np.prod(mesh))])


@pytest.mark.slow
def test_latent_attention_caches_its_latents_and_decodes_as_recomputing():
  """DeepSeek's latent attention caches each position's latent and rotary key (12 + 4 numbers
  per layer, not 4 heads x (8 + 4 + 6)); its cached greedy decoding equals recomputing, on one
  device and on data 2 x tensor 2 (heads split, the cache whole over tensor)."""
  one_device = _latent_setup()
  params = one_device.init(0)[0]['params']
  generator = Generator(one_device, 16, NEW)
  outputs = generator.generate(params, PROMPTS, NEW)
  for prompt, out in zip(PROMPTS, outputs):
    assert list(out) == _recomputed(one_device, params, prompt, NEW)
  sharded_setup = _latent_setup((2, 1, 2))
  sharded = jax.device_put(params, sharded_setup.state_shardings()['params'])
  sharded_generator = Generator(sharded_setup, 16, NEW)
  for got, want in zip(sharded_generator.generate(sharded, PROMPTS, NEW), outputs):
    np.testing.assert_array_equal(got, want)
  cache, _ = sharded_generator.prefill(sharded, np.zeros((4, 16), np.int32),
                                       np.ones(4, np.int32), jax.random.key(0))
  assert (cache.keys(), cache['latent'].shape, cache['rope'].shape) == (
      {'latent', 'rope'}, (2, 4, 16 + NEW, 12), (2, 4, 16 + NEW, 4))
  assert sharded_generator.cache_bytes(4) == cache['latent'].nbytes + cache['rope'].nbytes


@pytest.mark.slow
def test_dense_first_layers_cache_in_the_models_order():
  """A dense layer before the stack writes the cache's first layer and the stacked ones the
  rest: cached greedy decoding equals recomputing."""
  setup = _latent_setup(dense_layers=1)
  params = setup.init(0)[0]['params']
  generator = Generator(setup, 16, NEW)
  for prompt, out in zip(PROMPTS, generator.generate(params, PROMPTS, NEW)):
    assert list(out) == _recomputed(setup, params, prompt, NEW)
  cache, _ = generator.prefill(params, np.zeros((4, 16), np.int32), np.ones(4, np.int32),
                               jax.random.key(0))
  assert cache['latent'].shape[0] == 3


def test_sampling_is_seeded_restricted_and_stops_at_end_of_text(model_and_params):
  _, train_setup, params = model_and_params
  greedy = Generator(train_setup, 16, NEW).generate(params, PROMPTS, NEW)
  warm = Generator(train_setup, 16, NEW, Sampling(temperature=1.0))
  first, again = (warm.generate(params, PROMPTS, NEW, seed=s) for s in (3, 3))
  other = warm.generate(params, PROMPTS, NEW, seed=4)
  assert all((a == b).all() for a, b in zip(first, again))
  assert any((a != b).any() for a, b in zip(first, other))
  for sampling in (Sampling(1.0, top_k=1), Sampling(1.0, top_p=1e-6)):  # Only the likeliest.
    narrow = Generator(train_setup, 16, NEW, sampling).generate(params, PROMPTS, NEW, seed=5)
    assert all((a == b).all() for a, b in zip(narrow, greedy))
  eos = int(greedy[0][2])  # Row 0 produces it at its third step: it stops there.
  stopped = Generator(train_setup, 16, NEW).generate(params, PROMPTS, NEW, eos_id=eos)
  assert list(stopped[0]) == list(greedy[0][:list(greedy[0]).index(eos) + 1])


@pytest.mark.slow
def test_generate_and_evaluate_a_trained_run(tmp_path):
  workdir = tmp_path / 'run'
  argv = ['--config=experiments/tiny.py', f'--workdir={workdir}', '--config.mesh.data=8',
          '--config.train.num_steps=2', '--config.data.tokenizer=char',
          '--config.model.num_layers=2']
  assert run_main(argv) == 0
  command = [sys.executable, '-m', 'engine.generate', f'--workdir={workdir}',
             '--max_new_tokens=20', '--temperature=0.8', '--top_k=20', '--seed=1']
  proc = subprocess.run(command + ['--prompt=def main():'], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("--- 'def main():'\ndef main():")
  proc = subprocess.run(command + ['--prompt=\u2603 snowman'], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "error: --prompt has characters the run's character vocabulary lacks: ['\u2603']")
  # Evaluate: the mean loss over the file's windows, against the plain model on each window.
  loaded, params = load_run(str(workdir), '1x1x1')
  config, tokenizer, train_setup = loaded.config, loaded.tokenizer, loaded.setup
  text = 'def add(a, b):\n    return a + b\n' * 20
  tokens = tokenizer.encode(text)
  result = evaluate(train_setup, params, tokens, config.data.seq_len, batch=4)
  model, seq = nnx.merge(train_setup.graphdef, params), config.data.seq_len
  losses = [float(optax.softmax_cross_entropy_with_integer_labels(
      model(tokens[None, i * seq:(i + 1) * seq]), tokens[None, i * seq + 1:(i + 1) * seq + 1]
  ).mean()) for i in range((len(tokens) - 1) // seq)]
  assert result['windows'] == len(losses) > 1
  assert result['loss'] == pytest.approx(np.mean(losses), abs=1e-5)
  assert result['perplexity'] == pytest.approx(np.exp(np.mean(losses)), rel=1e-5)


def _bos_tokenizer(directory):
  """A word-level tokenizer.json whose ids start with a beginning-of-text token (0) and an
  end-of-text one (1)."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  words = ['<|begin_of_text|>', '<|endoftext|>', '<unk>', *'the cat sat on a mat'.split()]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token='<unk>'))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(words[:2])
  tokenizer.save(str(directory / 'tokenizer.json'))
  return tokenizer_lib.load('hf', str(directory / 'tokenizer.json'))


@pytest.mark.slow
def test_new_tokens_default_to_what_the_model_allows(tmp_path):
  tokenizer = _bos_tokenizer(tmp_path)
  config = tiny_config()  # model.max_len = 16.
  texts = ['the cat sat', 'on a mat']  # 3 tokens each, after the beginning-of-text token.
  assert resolve_new_tokens(config, tokenizer, texts, 0, 0, add_bos=True) == 16 - 4  # GPT.
  assert resolve_new_tokens(config, tokenizer, texts, 0, 0, add_bos=False) == 16 - 3
  assert resolve_new_tokens(config, tokenizer, texts, 0, 10, add_bos=True) == 16 - 11
  assert resolve_new_tokens(config, tokenizer, texts, 7, 0, add_bos=True) == 7  # As given.
  with pytest.raises(ConfigError, match=r"^the prompt slots \(16\) fill the GPT model's 16 learned "
                     r'positions \(model.max_len\), leaving none to generate'):
    resolve_new_tokens(config, tokenizer, texts, 0, 15, add_bos=True)
  config.model.name = 'llama'  # Rotary positions: no cap, the default count.
  assert resolve_new_tokens(config, tokenizer, texts, 0, 0, add_bos=True) == 100


@pytest.mark.slow
def test_prompts_start_with_the_beginning_of_text_token_unless_noadd_bos(tmp_path):
  tokenizer = _bos_tokenizer(tmp_path)
  assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
  config = tiny_config()  # data.seq_len = model.max_len = 16.
  config.model.name = 'llama'
  texts = ['the cat sat', 'on a mat']
  # Rotary positions have no cap: by default the prompt slots are the longest prompt's.
  ids, slots = prompts_and_slots(config, tokenizer, texts, 0, 4, add_bos=True)
  assert [list(i) for i in ids] == [[0, 3, 4, 5], [0, 6, 7, 8]] and slots == 4
  ids, slots = prompts_and_slots(config, tokenizer, texts, 0, 4, add_bos=False)  # --noadd_bos
  assert [list(i) for i in ids] == [[3, 4, 5], [6, 7, 8]] and slots == 3
  # The token takes a cache slot of its own, beyond --max_prompt_len.
  sixteen = [' '.join(['the'] * 16)]  # Longer than data.seq_len: not a cap.
  assert prompts_and_slots(config, tokenizer, sixteen, 0, 4, add_bos=True)[1] == 17
  assert prompts_and_slots(config, tokenizer, sixteen, 0, 4, add_bos=False)[1] == 16
  with pytest.raises(ConfigError, match=r'^a prompt has 16 tokens, more than --max_prompt_len=15 '
                     r'\+ 1 beginning-of-text token; raise --max_prompt_len'):
    prompts_and_slots(config, tokenizer, sixteen, 15, 4, add_bos=True)
  assert prompts_and_slots(config, tokenizer, sixteen, 16, 4, add_bos=True)[1] == 17
  # A sliding window (Mistral): the cache attends within it, so generation may go past it;
  # latent attention computes no window, so there the window caps what generation may hold.
  config.model.sliding_window = 19
  assert prompts_and_slots(config, tokenizer, texts, 0, 16, add_bos=True)[1] == 4
  config.model.mla_kv_rank = 16
  with pytest.raises(ConfigError, match=r"--max_prompt_len=3 \+ 1 beginning-of-text token \+ "
                     r"--max_new_tokens=16 exceeds the model's sliding window of 19 tokens"):
    prompts_and_slots(config, tokenizer, texts, 0, 16, add_bos=True)
  assert prompts_and_slots(config, tokenizer, texts, 0, 15, add_bos=True)[1] == 4
  config.model.sliding_window, config.model.mla_kv_rank = 0, 0
  # GPT: its learned positions hold the token too.
  config.model.name = 'gpt'
  assert prompts_and_slots(config, tokenizer, texts, 0, 4, add_bos=True)[1] == 12
  with pytest.raises(ConfigError, match=r'--max_prompt_len=12 \+ 1 beginning-of-text token \+ '
                     r'--max_new_tokens=4 exceeds the GPT model\'s 16 learned positions'):
    prompts_and_slots(config, tokenizer, texts, 12, 4, add_bos=True)
  # engine.evaluate: the file's tokens after it; a tokenizer without one adds nothing.
  assert list(encode_prompts(tokenizer, ['the mat'], True, '--text_file')[0]) == [0, 3, 8]
  byte = tokenizer_lib.ByteTokenizer()
  assert list(encode_prompts(byte, ['hi'], True)[0]) == [104, 105]


@pytest.mark.slow
def test_generate_and_evaluate_take_noadd_bos(tmp_path):
  """The flag is there: the commands get as far as the mesh (a finished run's record is all
  they read before it)."""
  (tmp_path / 'config.json').write_text(default_config().to_json())
  commands = [['engine.generate', '--prompt=a'], ['engine.evaluate', '--text_file=README.md']]

  def call(argv):
    return subprocess.run([sys.executable, '-m', *argv, f'--workdir={tmp_path}', '--noadd_bos',
                           '--mesh=2x'], cwd=ROOT, capture_output=True, text=True, timeout=300)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for proc in pool.map(call, commands):
      assert proc.returncode == 2 and proc.stderr.startswith('error: --mesh=2x: a mesh is'), (
          proc.stderr[-2000:])
