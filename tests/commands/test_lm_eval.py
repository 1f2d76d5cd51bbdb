"""engine.lm_eval: the scorer behind lm-eval's log-likelihood requests against the model's own
log-softmax computed apart, in NumPy (one device and a 2x2x2 mesh; a long context keeps its last
tokens); and, in the reference environment (tests/support/reference_envs.py: lm_eval, torch,
transformers, this engine seen through it), the command on four local tasks (multiple choice, a scored continuation, generation,
rolling perplexity) against lm-eval's own Hugging Face model on the run's export."""

import json
import os
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from engine.assemble import lay_out
from engine.lm_eval.scoring import Scorer
from engine.models.ops import LocalOps
from tests.support import lm_eval_tasks
from tests.support.helpers import reference_python, tiny_config

VOCAB, WINDOW = 64, 16


def _setup(mesh):
  config = tiny_config(mesh=mesh)
  config.model.name, config.model.num_kv_heads = 'llama', 2
  config.data.seq_len = WINDOW
  return lay_out(config, VOCAB, jax.devices()[:int(np.prod(mesh))])


def _reference(setup, params, context, continuation):
  """The continuation's log-probability and greedy match from the plain forward pass."""
  whole = (context + continuation)[-(WINDOW + 1):]
  logits = np.asarray(nnx.merge(setup.graphdef, params)(np.asarray([whole[:-1]]), LocalOps())[0],
                      np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  first = len(whole) - len(continuation) - 1
  targets = whole[first + 1:]
  rows = range(first, len(whole) - 1)
  return (sum(logprobs[r, t] for r, t in zip(rows, targets)),
          all(logits[r].argmax() == t for r, t in zip(rows, targets)))


@pytest.mark.parametrize('mesh', [(1, 1, 1), (2, 2, 2)])
def test_continuations_score_as_the_model_computes_them(mesh):
  one = _setup((1, 1, 1))
  params = jax.device_get(one.init(0)[0]['params'])
  setup = _setup(mesh)
  scorer = Scorer(setup, jax.device_put(params, setup.state_shardings()['params']), WINDOW, 3)
  rng = np.random.default_rng(0)
  pairs = [([int(t) for t in rng.integers(1, VOCAB, n)], [int(t) for t in rng.integers(1, VOCAB, m)])
           for n, m in ((5, 3), (1, 1), (30, 4), (10, 6), (2, 9))]  # (30, 4): truncated.
  # A continuation the model predicts greedily: its own argmax, token by token.
  context = [3, 4, 5]
  for _ in range(3):
    whole = np.asarray([context])
    context = context + [int(np.asarray(nnx.merge(one.graphdef, params)(whole, LocalOps()))[0, -1]
                             .argmax())]
  pairs.append(([3, 4, 5], context[3:]))
  got = scorer.continuations(pairs)
  for (logprob, greedy), (context, continuation) in zip(got, pairs):
    want_logprob, want_greedy = _reference(one, params, context, continuation)
    np.testing.assert_allclose(logprob, want_logprob, rtol=1e-5, atol=1e-5)
    assert greedy == want_greedy
  assert got[-1][1] and not all(g for _, g in got[:-1])


@pytest.mark.slow
def test_lm_eval_scores_the_run_as_it_scores_its_export(tmp_path):
  python = reference_python()
  from engine.data.bpe_trainer import train as train_bpe  # pylint: disable=g-import-not-at-top
  from engine.export.exporter import export_files  # pylint: disable=g-import-not-at-top
  from engine.main import run as run_main  # pylint: disable=g-import-not-at-top
  tasks = lm_eval_tasks.write(str(tmp_path / 'tasks'))
  text = ''.join(json.loads(line)['question'] + json.loads(line)['answer'] + '\n'
                 for line in open(os.path.join(tasks, 'arith.jsonl'))) * 20
  (tmp_path / 'train.txt').write_text(text)
  train_bpe([text], 300, str(tmp_path / 'bpe.json'))
  assert run_main(['--config=experiments/llama_bench.py:steps=10', f'--workdir={tmp_path / "run"}',
                   '--config.data.source=file', f'--config.data.path={tmp_path / "train.txt"}',
                   '--config.data.tokenizer=hf', f'--config.data.tokenizer_path={tmp_path / "bpe.json"}',
                   '--config.model.vocab_size=-1', '--config.data.seq_len=64']) == 0
  export_files(str(tmp_path / 'run'), str(tmp_path / 'hf'))
  env = dict(os.environ, HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1', JAX_PLATFORMS='cpu')
  names = ','.join(lm_eval_tasks.TASKS)
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  for args in (['-m', 'engine.lm_eval', f'--workdir={tmp_path / "run"}', f'--tasks={names}',
                f'--include_path={tasks}', f'--out={tmp_path / "engine"}'],
               ['-m', 'lm_eval', '--model', 'hf', '--model_args',
                f'pretrained={tmp_path / "hf"},dtype=float32,trust_remote_code=True', '--device',
                'cpu', '--tasks', names, '--include_path', tasks, '--output_path',
                str(tmp_path / 'hf_results')]):
    proc = subprocess.run([python, *args], env=env, cwd=root, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
  engine = json.loads((tmp_path / 'engine.json').read_text())['results']
  (found,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / 'hf_results')
              for f in files if f.startswith('results')]
  hf = json.load(open(found))['results']
  compared = 0
  for task in lm_eval_tasks.TASKS:
    for metric, value in hf[task].items():
      if metric.endswith(',none') and 'stderr' not in metric:
        np.testing.assert_allclose(engine[task][metric], value, rtol=1e-4, err_msg=metric)
        compared += 1
  assert compared == 7
