"""engine.evaluate: the held-out split is the training eval's (its loss is the logged eval loss,
and a NumPy loss over the same windows), for a text source (byte tokens) and a shard set (BPE
tokens); bits per byte against hand counts of the bytes, for byte and BPE tokenizers; the
command's line."""

import json
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

from engine import parallel
from engine.train import loop as train
from engine.assemble import CORPUS, assemble_finished_run, lay_out
from engine.workdir.checkpoint import restore_params
from engine.data import tokenizers as tokenizer_lib
from engine.data.shard_writer import prepare
from engine.data.bpe_trainer import train as train_bpe
from engine.evaluate.scoring import decoding_tokenizer, evaluate, heldout_windows, score
from tests.support.helpers import tiny_config
from tests.support.processes import forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_rng = np.random.default_rng(0)
# ASCII (a window's decoded targets count their bytes exactly), no two windows alike.
TEXT = ''.join(f'{" ".join(map(str, _rng.integers(0, 500, 10)))} the cat sat.\n'
               for _ in range(120))
UNICODE = 'An Ünïcödé café, naïve résumé 🙂 — the cat sat on the mat.\n' * 6
EOT = '<|endoftext|>'


@pytest.fixture(scope='module')
def bpe(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('bpe') / 'tokenizer.json')
  train_bpe([TEXT, UNICODE], 320, path)
  return tokenizer_lib.load('hf', path)


@pytest.fixture(scope='module', params=['file', 'shards'])
def trained(request, bpe, tmp_path_factory):
  """(workdir, its logged eval loss): two steps on data=8 devices, evaluated at the end."""
  root = tmp_path_factory.mktemp(request.param)
  (root / 'text.txt').write_text(TEXT)
  config = tiny_config(mesh=(8, 1, 1), steps=2)
  config.data.source = request.param
  if request.param == 'file':
    config.data.path = str(root / 'text.txt')
  else:
    prepare([str(root / 'text.txt')], 'hf', bpe.path, str(root / 'set'), processes=1,
            record_tokens=64, records_per_shard=8)
    config.data.shards, config.data.tokenizer = str(root / 'set'), 'hf'
  result = train.train(config, str(root / 'run'))
  lines = (root / 'run' / 'metrics.jsonl').read_text().splitlines()
  logged = [json.loads(line)['eval/loss'] for line in lines if 'eval/loss' in line][-1]
  assert logged == pytest.approx(result.eval_losses[2], abs=1e-6)
  return root, logged


def _numpy_losses(train_setup, params, windows) -> np.ndarray:
  """Each predicted token's cross-entropy, from the plain model's logits in NumPy."""
  logits = np.asarray(jax.jit(lambda p, t: nnx.merge(train_setup.graphdef, p)(t))(
      params, windows[:, :-1]), np.float64)
  top = logits.max(-1, keepdims=True)
  log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, windows[:, 1:, None], -1)[..., 0]


@pytest.mark.slow
def test_heldout_loss_is_the_logged_eval_loss(trained):
  root, logged = trained
  run = assemble_finished_run(str(root / 'run'), '1x1x1', reads=CORPUS)
  params = restore_params(str(root / 'run'), run.setup.abstract_state()['params'])
  windows = heldout_windows(run, run.config.train.eval_batches)
  assert windows.shape == (2 * 16, 17)
  tokenizer = decoding_tokenizer(run)
  result = score(run.setup, params, windows, 5, tokenizer)  # 5: the last call padded.
  assert result['loss'] == pytest.approx(logged, abs=1e-5)
  nats = _numpy_losses(run.setup, params, windows)
  assert result['loss'] == pytest.approx(nats.mean(), abs=1e-5)
  if tokenizer.kind == 'byte':
    # Every window lies in the held-out tail of the text, none in the training part.
    held_out, trained_on = bytes(run.corpus.val_tokens), bytes(run.corpus.train_tokens)
    assert all(bytes(w) in held_out and bytes(w) not in trained_on for w in windows)
    num_bytes = windows[:, 1:].size
  else:
    # ASCII text: each window's targets decode to their bytes (the end-of-text token: none).
    num_bytes = sum(len(tokenizer.decode(w[1:]).replace(EOT, '').encode()) for w in windows)
    assert num_bytes > windows[:, 1:].size  # Subword tokens: more than a byte each.
  assert result['bytes'] == num_bytes
  assert result['bits_per_byte'] == pytest.approx(nats.sum() / math.log(2) / num_bytes,
                                                  rel=1e-5)


@pytest.mark.slow
def test_the_command_scores_the_heldout_split_or_a_file(trained):
  root, logged = trained
  rows = [{'program': 'engine.evaluate', 'cwd': ROOT, 'argv': [f'--workdir={root}/run', *more]}
          for more in ([], ['--eval_batches=1'], [f'--text_file={root}/text.txt'])]
  heldout, first, text_file = (r['output'].strip().splitlines()[-1]
                               for r in forked(rows, timeout_s=600))
  assert heldout.startswith("held-out split (the training eval's 2 batches of 16 windows; "
                            'data.val_fraction=0.1): loss '), heldout
  assert float(heldout.split('loss ')[1].split(',')[0]) == pytest.approx(logged, abs=2e-4)
  assert 'bits per byte over 512 tokens' in heldout and 'perplexity' in heldout
  assert first.startswith("held-out split (1 eval batches (the training eval's: the first 2) "
                          'of 16 windows; data.val_fraction=0.1): loss '), first
  assert 'over 256 tokens' in first
  assert text_file.startswith(f'text file {root}/text.txt: loss '), text_file
  assert 'bits per byte' in text_file


def test_bits_per_byte_of_byte_and_bpe_tokens_on_a_file(bpe):
  config = tiny_config()  # data.seq_len 16.
  train_setup = lay_out(config, bpe.vocab_size, jax.devices()[:1])
  params = train_setup.init(0)[0]['params']
  byte = tokenizer_lib.ByteTokenizer()
  for tokenizer in (byte, bpe):
    tokens = tokenizer.encode(UNICODE)
    # The byte counts add up to the text's, tokens holding part of a character included.
    assert tokenizer.byte_lengths(tokens).sum() == len(UNICODE.encode())
    result = evaluate(train_setup, params, tokens, 16, 4, tokenizer)
    count = (len(tokens) - 1) // 16
    windows = np.stack([tokens[i * 16:i * 16 + 17] for i in range(count)])
    nats = _numpy_losses(train_setup, params, windows)
    assert result['loss'] == pytest.approx(nats.mean(), abs=1e-5)
    # The predicted tokens' bytes: the text after the first token, up to the last window's end
    # (bytes: one a token; BPE: the text, cut between characters there, of those tokens).
    end = count * 16 + 1
    if tokenizer is byte:
      num_bytes = end - 1
    else:
      assert (tokenizer.decode(tokens[:1]) + tokenizer.decode(tokens[1:end])
              + tokenizer.decode(tokens[end:])) == UNICODE
      num_bytes = len(tokenizer.decode(tokens[1:end]).encode())
    assert result['bytes'] == num_bytes
    assert result['bits_per_byte'] == pytest.approx(nats.sum() / math.log(2) / num_bytes,
                                                    rel=1e-5)
    if tokenizer is byte:
      assert result['bits_per_byte'] == pytest.approx(result['loss'] / math.log(2), rel=1e-6)
    else:
      assert num_bytes > result['tokens']
      assert any('\ufffd' in bpe.decode([t]) for t in tokens)  # Part of a character alone.
  assert bpe.byte_lengths(np.array([bpe.eos_id, bpe.eos_id])).tolist() == [0, 0]


def _documents_layout(mesh=(1, 1, 1, 1, 1)):
  """A tiny Llama with packed documents (end-of-text id 0), on `mesh` (data, fsdp, tensor,
  context, stage)."""
  config = tiny_config(mesh=mesh[:3])
  config.mesh.context, config.mesh.stage = mesh[3:]
  config.model.name, config.model.num_kv_heads = 'llama', 2
  config.data.global_batch_size, config.data.document_masking = 8, True
  return lay_out(config, 32, jax.devices()[:int(np.prod(mesh))], eos_id=0)


@pytest.mark.parametrize('mode, mesh', [
    ('manual', (2, 1, 2, 2, 1)), ('auto', (2, 1, 2, 2, 1)),  # Vocabulary and sequence split.
    ('manual', (2, 1, 2, 1, 2)),  # A pipeline.
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_window_losses_are_the_eval_steps_loss_per_window(mode, mesh):
  one = _documents_layout()
  params = one.init(0)[0]['params']
  rng = np.random.default_rng(2)
  tokens = rng.integers(1, 32, (8, 17))
  tokens[rng.random((8, 17)) < 1 / (2 + np.arange(8)[:, None])] = 0  # Unequal counts per row.
  want_sums, want_counts = parallel.build_steps('auto', one).window_losses(params, tokens)
  setup = _documents_layout(mesh)
  steps = parallel.build_steps(mode, setup)
  params = jax.device_put(jax.device_get(params), setup.state_shardings()['params'])
  sums, counts = jax.device_get(steps.window_losses(params, tokens))
  assert counts.tolist() == (tokens[:, :-1] != 0).sum(-1).tolist()  # By hand.
  assert np.asarray(want_counts).tolist() == counts.tolist()
  np.testing.assert_allclose(sums, want_sums, rtol=1e-5)
  assert len(set(np.round(sums / counts, 3))) > 1  # Rows differ: a mixed-up row would show.
  assert sums.sum() / counts.sum() == pytest.approx(float(steps.eval(params, tokens)), abs=1e-5)
