"""The data pipeline: tokenisers, sources, determinism, per-process slices."""

import numpy as np
import pytest

from engine import data
from engine.data import tokenizers as tokenizer_lib
from tests.support.helpers import tiny_config


@pytest.mark.parametrize('kind', ['byte', 'char'])
def test_tokenizers_round_trip(kind):
  text = 'To be, or not to be: that is the question.\n'
  tokenizer = tokenizer_lib.load(kind, text=text)
  ids = tokenizer.encode(text)
  assert ids.dtype == np.int32 and ids.max() < tokenizer.vocab_size
  assert tokenizer.decode(ids) == text
  assert tokenizer.vocab_size == (256 if kind == 'byte' else len(set(text)))


def test_embedded_corpus_is_real_python_source():
  text = data.embedded_corpus(200_000)
  assert len(text) == 200_000
  assert 'def ' in text and 'import ' in text and '# ---- ' in text


def test_corpus_split_is_disjoint_and_ordered():
  config = tiny_config().data
  corpus = data.load_corpus(config, seed=0)
  total = len(corpus.train_tokens) + len(corpus.val_tokens)
  assert total == config.synthetic_tokens
  assert len(corpus.val_tokens) == pytest.approx(0.1 * total, abs=1)


def _batches(tokens, process, processes, seed=0, count=5):
  dataset = data.windows_dataset(tokens, 16, 16, seed, process, processes)
  return [dataset[i] for i in range(count)]


def test_pipeline_is_deterministic_and_seeded():
  tokens = np.arange(10_000, dtype=np.int32)
  first, again = _batches(tokens, 0, 1), _batches(tokens, 0, 1)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, b)
  other_seed = _batches(tokens, 0, 1, seed=1)
  assert not np.array_equal(first[0], other_seed[0])
  # Each row is a contiguous window of seq_len + 1 tokens.
  assert first[0].shape == (16, 17)
  np.testing.assert_array_equal(np.diff(first[0], axis=1), 1)


@pytest.mark.parametrize('processes', [2, 4])
def test_process_slices_are_disjoint_and_form_the_global_batch(processes):
  tokens = np.arange(10_000, dtype=np.int32)
  whole = _batches(tokens, 0, 1)
  slices = [_batches(tokens, p, processes) for p in range(processes)]
  for step in range(len(whole)):
    parts = [slices[p][step] for p in range(processes)]
    assert all(part.shape == (16 // processes, 17) for part in parts)
    starts = [set(part[:, 0].tolist()) for part in parts]
    for i in range(processes):
      for j in range(i + 1, processes):
        assert not starts[i] & starts[j]
    np.testing.assert_array_equal(np.concatenate(parts), whole[step])


def test_iterator_state_restores_position():
  config = tiny_config().data
  corpus = data.load_corpus(config, seed=0)
  iterator = data.train_iterator(corpus, config, seed=0)
  for _ in range(3):
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(2)]
  fresh = data.train_iterator(corpus, config, seed=0)
  fresh.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(next(fresh), batch)
