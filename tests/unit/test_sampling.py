"""Sampling (engine/generate/sampling.py) on crafted logits: greedy at temperature 0, the default
draws (nanoGPT's temperature 0.8 and top-k 200), and top-k's restriction to the k best."""

import jax
import numpy as np

from engine.generate.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, Sampling, sample

DEFAULT = Sampling(DEFAULT_TEMPERATURE, DEFAULT_TOP_K)


def _logits(rows: int = 64, vocab: int = 300) -> np.ndarray:
  return np.random.default_rng(0).normal(size=(rows, vocab)).astype(np.float32)


def _draw(logits, sampling: Sampling, seed: int = 0) -> np.ndarray:
  return np.asarray(sample(logits, jax.random.key(seed), sampling))


def test_temperature_zero_is_the_argmax_whatever_the_seed():
  logits = _logits()
  for seed in range(3):
    np.testing.assert_array_equal(_draw(logits, Sampling(0.0, DEFAULT_TOP_K), seed),
                                  logits.argmax(-1))


def test_the_defaults_draw_seeded_samples_unlike_greedy():
  assert (DEFAULT_TEMPERATURE, DEFAULT_TOP_K) == (0.8, 200)  # nanoGPT's sample.py.
  logits = _logits()
  draws = [_draw(logits, DEFAULT, seed) for seed in range(4)]
  for drawn in draws:
    assert (drawn != logits.argmax(-1)).mean() > 0.5  # 300 near-equal tokens: rarely the best.
  assert all((a != b).any() for a, b in zip(draws, draws[1:]))  # Each seed its own draws,
  np.testing.assert_array_equal(draws[0], _draw(logits, DEFAULT, 0))  # the same seed the same.


def test_top_k_draws_only_among_the_k_best():
  vocab, k, rows = 50, 5, 4000
  best = [3, 8, 17, 22, 40]
  logits = np.zeros((rows, vocab), np.float32)
  logits[:, best] = np.linspace(1.0, 1.4, k)  # The others, at 0, hold most of the mass.
  restricted = _draw(logits, Sampling(1.0, top_k=k))
  assert set(np.unique(restricted)) == set(best)  # Each of the k best, and nothing else;
  everything = _draw(logits, Sampling(1.0, top_k=0))
  assert not set(np.unique(everything)) <= set(best)  # unrestricted, the others come too.
  # A k beyond the vocabulary (the default's 200 here) restricts nothing, and is no error.
  np.testing.assert_array_equal(_draw(logits, Sampling(1.0, top_k=DEFAULT_TOP_K)), everything)
