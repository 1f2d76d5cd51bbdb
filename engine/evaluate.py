"""Loss and perplexity of a run's latest checkpoint on a text file.

  python -m engine.evaluate --workdir=/tmp/shakespeare --text_file=../shared/data/tinyshakespeare.txt

The file is tokenized with the run's tokenizer, after its beginning-of-text token if it has one
(as engine.data.prepare starts each document; --noadd_bos: not), and cut into consecutive windows
of data.seq_len + 1 tokens (the last partial one dropped); the loss is the mean next-token
cross-entropy over every predicted token, the perplexity its exponential (per token of that
tokenizer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from flax import nnx

from engine import config as config_lib
from engine.assemble import assemble_finished_run
from engine.checkpoint import restore_params
from engine.cli import run_command
from engine.generate import add_bos_flag, bos_ids, encode_prompts
from engine.parallel.auto import AutoOps
from engine.text_files import read_text


def check_length(tokens: np.ndarray, seq_len: int, what: str = 'the text') -> None:
  """Refuses a text shorter than one window of seq_len + 1 tokens, before anything compiles."""
  if len(tokens) < seq_len + 1:
    raise config_lib.ConfigError(
        f'{what} holds {len(tokens)} tokens, fewer than one window of the run\'s data.seq_len + '
        f'1 = {seq_len + 1}; pass a longer text.')


def evaluate(setup, params, tokens: np.ndarray, seq_len: int, batch: int) -> dict:
  """Mean loss over the consecutive windows of `tokens`, `batch` windows per compiled call."""
  check_length(tokens, seq_len)
  count = (len(tokens) - 1) // seq_len
  windows = np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])
  ops = AutoOps(setup)

  @jax.jit
  def row_losses(params, tokens_BL1):
    logits = ops.prepare_params(nnx.merge(setup.graphdef, params))(tokens_BL1[:, :-1], ops)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens_BL1[:, 1:]).mean(axis=-1)

  total = 0.0
  for start in range(0, count, batch):
    rows = windows[start:start + batch]
    padded = np.concatenate([rows, np.repeat(rows[-1:], batch - len(rows), axis=0)])
    total += float(np.asarray(row_losses(params, padded))[:len(rows)].sum())
  loss = total / count
  return {'loss': loss, 'perplexity': math.exp(loss), 'windows': count,
          'tokens': count * seq_len}


def main():
  workdir = flags.DEFINE_string('workdir', None, 'The training run to evaluate.')
  text_file = flags.DEFINE_string('text_file', None, 'A UTF-8 text file.')
  batch = flags.DEFINE_integer('batch', 8, 'Windows per compiled call.')
  mesh = flags.DEFINE_string('mesh', '1x1x1', f'Mesh {config_lib.MESH_FORMAT} (axes not given '
                             'are 1; its devices are the first ones).')
  add_bos = add_bos_flag()

  def run(argv):
    del argv
    if batch.value < 1:
      raise config_lib.ConfigError(f'--batch={batch.value} must be at least 1.')
    text = read_text(text_file.value, f'--text_file={text_file.value}')
    loaded = assemble_finished_run(workdir.value, mesh.value)
    config, tokenizer = loaded.config, loaded.tokenizer
    tokens, = encode_prompts(tokenizer, [text], add_bos.value, '--text_file')
    check_length(tokens, config.data.seq_len, f'--text_file={text_file.value}')
    params = restore_params(workdir.value, loaded.setup.abstract_state()['params'])
    bos = ', the beginning-of-text token first' if bos_ids(tokenizer, add_bos.value) else ''
    result = evaluate(loaded.setup, params, tokens, config.data.seq_len, batch.value)
    print(f'{text_file.value}: loss {result["loss"]:.4f}, perplexity {result["perplexity"]:.3f} '
          f'over {result["tokens"]} tokens ({result["windows"]} windows of '
          f'{config.data.seq_len}), {tokenizer.kind} tokens{bos}')

  run_command(run, 'engine.evaluate', required=('workdir', 'text_file'))


if __name__ == '__main__':
  main()
