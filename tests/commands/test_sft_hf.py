"""experiments/sft_hf.py as its docstring runs it: conversations prepared with a checkpoint's chat
template (a tiny Qwen2 with a ChatML tokenizer, written by the test), fine-tuned from the
checkpoint in manual mode on a mesh, then scored on the held-out conversations: the loss counts
the answers' tokens only."""

import json

import numpy as np
import pytest

from engine.data.shard_writer import prepare
from engine.evaluate import scoring
from engine.main import run as run_main
from engine.workdir.checkpoint import restore_params
from engine.models.documents import CONTEXT_FLAG
from tests.support import chat_tokenizers
from tests.unit.test_hf_families import FAMILIES, _checkpoint

pytestmark = pytest.mark.slow  # Trains.


def test_sft_trains_and_scores_the_answers_only(tmp_path, monkeypatch):
  checkpoint = tmp_path / 'chatml'
  tokenizer = chat_tokenizers.write(str(tmp_path), 'chatml')
  _checkpoint(checkpoint, dict(FAMILIES['qwen2'], vocab_size=400))
  with open(tmp_path / 'chats.jsonl', 'w') as f:
    for i in range(60):
      f.write(json.dumps({'messages': chat_tokenizers.CONVERSATIONS[i % 2]}) + '\n')
  prepare([str(tmp_path / 'chats.jsonl')], 'hf', tokenizer, str(tmp_path / 'chat_shards'),
          processes=1, record_tokens=256, messages_field='messages')
  monkeypatch.chdir(tmp_path.parent)
  code = run_main([
      f'--config={__file__.rsplit("/tests/", 1)[0]}/experiments/sft_hf.py:hf={checkpoint},'
      f'data={tmp_path / "chat_shards"},steps=3,mode=manual,mesh=2x2x2',
      f'--workdir={tmp_path / "sft"}', '--config.data.seq_len=32',
      '--config.data.global_batch_size=8', '--config.model.dtype=float32',
      '--config.train.eval_batches=1', '--config.train.log_every=1'])
  assert code == 0
  records = [json.loads(line) for line in open(tmp_path / 'sft' / 'metrics.jsonl')]
  assert all(np.isfinite(r['train/loss']) for r in records if 'train/loss' in r)
  # The held-out windows, scored as engine.evaluate scores them: only the answers count.
  loaded = scoring.assemble_finished_run(str(tmp_path / 'sft'), '1x1x1', reads=scoring.CORPUS)
  windows = scoring.heldout_windows(loaded, 1)
  params = restore_params(str(tmp_path / 'sft'), loaded.setup.abstract_state()['params'])
  result = scoring.score(loaded.setup, params, windows, 8, steps=loaded.steps)
  # Every trained target follows a token of its own conversation, so each is counted.
  answers = int(((windows[:, 1:] & CONTEXT_FLAG) == 0).sum())
  assert np.isfinite(result['loss']) and 0 < result['tokens'] == answers
  assert answers < 0.5 * windows[:, 1:].size  # Most of a conversation is context.
