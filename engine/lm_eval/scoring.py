"""What lm-eval's requests ask of a model, on a run's compiled forward pass: each continuation's
log-likelihood given its context, and whether greedy decoding would produce it.

Requests are scored `batch` at a time in windows of the run's data.seq_len + 1 tokens (one
compile): a context longer than the window keeps its last tokens, as lm-eval's Hugging Face
model does; rows are right-padded. The forward pass is auto mode's on the run's mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.errors import ConfigError
from engine.parallel.auto import AutoOps


class Scorer:
  """Log-probabilities and greedy matches of tokens under a run's parameters."""

  def __init__(self, setup, params, window: int, batch: int):
    ways = math.prod(setup.mesh.shape[a] for a in setup.rules.mesh_axes('batch', True))
    self.window, self.batch = window, -(-batch // ways) * ways
    self.params = params
    ops = AutoOps(setup)
    batch_sharding = setup.batch_sharding()
    rows = NamedSharding(setup.mesh, P(batch_sharding.spec[0]))

    def token_scores(params, tokens_BL1):
      model = ops.prepare_params(nnx.merge(setup.graphdef, params))
      logits_BLV = model(tokens_BL1[:, :-1], ops).astype(jnp.float32)
      targets_BL = tokens_BL1[:, 1:]
      logprobs_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
      chosen_BL = jnp.take_along_axis(logprobs_BLV, targets_BL[..., None], axis=-1)[..., 0]
      return chosen_BL, jnp.argmax(logits_BLV, axis=-1) == targets_BL

    self._scores = jax.jit(token_scores,
                           in_shardings=(setup.state_shardings()['params'], batch_sharding),
                           out_shardings=(rows, rows))

  def continuations(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(sum of the continuation's token log-probabilities, whether each of its tokens is the
    greedy choice) of each (context ids, continuation ids) pair."""
    results = []
    for start in range(0, len(pairs), self.batch):
      chunk = pairs[start:start + self.batch]
      tokens = np.zeros((self.batch, self.window + 1), np.int32)
      spans = []
      for row, (context, continuation) in enumerate(chunk):
        if not continuation:
          raise ConfigError('an lm-eval request has an empty continuation; nothing to score.')
        whole = (list(context) + list(continuation))[-(self.window + 1):]
        tokens[row, :len(whole)] = whole
        # Predictions of the continuation: from position len(whole) - len(continuation) - 1 on.
        first = len(whole) - len(continuation) - 1
        if first < 0:
          raise ConfigError(f'an lm-eval continuation of {len(continuation)} tokens does not fit '
                            f'the run\'s window of {self.window} predictions.')
        spans.append((first, len(whole) - 1))
      logprobs, greedy = map(np.asarray, self._scores(self.params, tokens))
      for row, (first, last) in enumerate(spans):
        results.append((float(logprobs[row, first:last].sum()),
                        bool(greedy[row, first:last].all())))
    return results
