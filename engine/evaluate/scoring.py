"""Loss, perplexity and bits per byte of a run's latest checkpoint: on the run's held-out split
(by default), or on a text file.

  python -m engine.evaluate --workdir=/tmp/shakespeare
  python -m engine.evaluate --workdir=/tmp/shakespeare --text_file=experiments/data/tinyshakespeare.txt

The held-out split is the training eval's: the same windows (the last data.val_fraction of the
corpus, or of each shard set's packed windows; train.eval_batches fixed batches of
data.global_batch_size windows, engine.data.eval_batches), so its loss is the one the training
log reports as eval loss for that checkpoint (--eval_batches: more or fewer of those batches).

A text file is tokenized with the run's tokenizer, after its beginning-of-text token if it has one
(as engine.data.prepare starts each document; --noadd_bos: not), and cut into consecutive windows
of data.seq_len + 1 tokens (the last partial one dropped).

The loss is the mean next-token cross-entropy over every predicted token (with
data.document_masking, the training's masking: the predictions from an end-of-text token
skipped), summed per window by the run's mode's own eval loss on the --mesh layout
(Steps.window_losses, engine/parallel/steps.py), the perplexity its exponential (per token of
that tokenizer); bits per byte, the summed cross-entropy in bits over the UTF-8 bytes those
predicted tokens stand for (special tokens: none), compares tokenizers.
"""

from __future__ import annotations

import math

import numpy as np

from engine import data
from engine.assemble import CORPUS, Run, assemble_finished_run
from engine.workdir.checkpoint import restore_params
from engine.data import tokenizers as tokenizer_lib
from engine.data.prompts import bos_ids, encode_prompts
from engine.models import documents
from engine.parallel import auto
from engine.parallel.steps import Steps, kept_tokens
from engine.data.text_files import read_text
from engine.errors import ConfigError
from engine.runtime.progress import Progress


def check_length(tokens: np.ndarray, seq_len: int, what: str = 'the text') -> None:
  """Refuses a text shorter than one window of seq_len + 1 tokens, before anything compiles."""
  if len(tokens) < seq_len + 1:
    raise ConfigError(
        f'{what} holds {len(tokens)} tokens, fewer than one window of the run\'s data.seq_len + '
        f'1 = {seq_len + 1}; pass a longer text.')


def window_losses(setup, params, windows: np.ndarray, batch: int, steps: Steps | None = None):
  """Each [seq_len + 1] window's summed next-token loss and the number of predictions summed
  (all of them; with packed documents, data.document_masking, those from an end-of-text token
  skipped, as training does): the eval step's loss per window (Steps.window_losses of `steps`,
  the run's mode's; by default auto mode's on `setup`), `batch` windows per compiled call
  (rounded up to the mesh's batch devices; the last call padded with copies of its last row)."""
  program = (steps or auto.build_steps(setup)).window_losses
  ways = math.prod(setup.mesh.shape[a] for a in setup.rules.mesh_axes('batch', True))
  batch = -(-batch // ways) * ways
  sums, counts = [], []
  progress = Progress(-(-len(windows) // batch), 'Scoring', 'batch')  # The first one compiles.
  for start in range(0, len(windows), batch):
    rows = windows[start:start + batch]
    padded = np.concatenate([rows, np.repeat(rows[-1:], batch - len(rows), axis=0)])
    summed, count = program(params, padded)
    sums.append(np.asarray(summed, np.float64)[:len(rows)])
    counts.append(np.asarray(count)[:len(rows)])
    progress.update()
  progress.finish()
  return np.concatenate(sums), np.concatenate(counts)


def score(setup, params, windows: np.ndarray, batch: int, tokenizer=None,
          steps: Steps | None = None) -> dict:
  """Loss and perplexity over `windows` (and bits per byte, given the tokenizer that decodes
  their ids), from window_losses."""
  sums, counts = window_losses(setup, params, windows, batch, steps)
  loss = float(sums.sum() / max(counts.sum(), 1))  # The mean over every counted prediction.
  result = {'loss': loss, 'perplexity': math.exp(loss), 'windows': len(windows),
            'tokens': int(counts.sum())}
  if tokenizer is not None:
    keep = kept_tokens(windows, setup.options.eos_id)[:, :-1]  # Of the targets windows[:, 1:].
    num_bytes = int(tokenizer.byte_lengths(documents.token_ids(windows[:, 1:])[keep]).sum())
    nats = float(sums.sum())
    result['bytes'] = num_bytes
    result['bits_per_byte'] = nats / math.log(2) / num_bytes if num_bytes else math.nan
  return result


def evaluate(setup, params, tokens: np.ndarray, seq_len: int, batch: int,
             tokenizer=None, steps: Steps | None = None) -> dict:
  """score() over the consecutive windows of `tokens`."""
  check_length(tokens, seq_len)
  count = (len(tokens) - 1) // seq_len
  windows = np.stack([tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])
  return score(setup, params, windows, batch, tokenizer, steps)


def heldout_windows(run: Run, num_batches: int) -> np.ndarray:
  """The training eval's held-out windows (its first `num_batches` batches), one process's
  view being the whole batch: [num_batches * data.global_batch_size, seq_len + 1]."""
  config = run.config
  return np.concatenate(data.eval_batches(run.corpus, config.data, config.seed, num_batches))


def decoding_tokenizer(run: Run):
  """The run's tokenizer that decodes (a shard set's record names its file)."""
  if run.corpus is not None and run.corpus.shard_sets:
    return tokenizer_lib.load(run.tokenizer.kind, run.tokenizer.path)
  return run.tokenizer


def _line(result: dict, what: str, seq_len: int, tokenizer, bos: str = '') -> str:
  return (f'{what}: loss {result["loss"]:.4f}, perplexity {result["perplexity"]:.3f}, '
          f'{result["bits_per_byte"]:.4f} bits per byte over {result["tokens"]} tokens '
          f'({result["bytes"]} bytes; {result["windows"]} windows of {seq_len}), '
          f'{tokenizer.kind} tokens{bos}')


def check_flags(batch: int, eval_batches: int | None, text_file: str | None) -> None:
  if batch < 1:
    raise ConfigError(f'--batch={batch} must be at least 1.')
  if eval_batches is not None and eval_batches < 1:
    raise ConfigError(f'--eval_batches={eval_batches} must be at least 1 (or leave '
                      'it out: the run\'s train.eval_batches).')
  if eval_batches is not None and text_file is not None:
    raise ConfigError(
        f'--eval_batches={eval_batches} counts held-out batches, but --text_file={text_file} is '
        'scored whole; drop one of them.')


def run_heldout(workdir: str, mesh: str, batch: int, eval_batches: int | None) -> str:
  loaded = assemble_finished_run(workdir, mesh, reads=CORPUS)
  config = loaded.config
  num_batches = eval_batches or config.train.eval_batches
  windows = heldout_windows(loaded, num_batches)
  params = restore_params(workdir, loaded.setup.abstract_state()['params'])
  tokenizer = decoding_tokenizer(loaded)
  result = score(loaded.setup, params, windows, batch, tokenizer, loaded.steps)
  batches = (f"the training eval's {num_batches} batches" if eval_batches is None else
             f"{num_batches} eval batches (the training eval's: the first "
             f'{config.train.eval_batches})')
  what = (f'held-out split ({batches} of {config.data.global_batch_size} windows; '
          f'data.val_fraction={config.data.val_fraction})')
  return _line(result, what, config.data.seq_len, tokenizer)


def run_text_file(workdir: str, mesh: str, batch: int, text_file: str, add_bos: bool) -> str:
  text = read_text(text_file, f'--text_file={text_file}')
  loaded = assemble_finished_run(workdir, mesh)
  config, tokenizer = loaded.config, loaded.tokenizer
  tokens, = encode_prompts(tokenizer, [text], add_bos, '--text_file')
  check_length(tokens, config.data.seq_len, f'--text_file={text_file}')
  params = restore_params(workdir, loaded.setup.abstract_state()['params'])
  bos = ', the beginning-of-text token first' if bos_ids(tokenizer, add_bos) else ''
  result = evaluate(loaded.setup, params, tokens, config.data.seq_len, batch, tokenizer,
                    loaded.steps)
  return _line(result, f'text file {text_file}', config.data.seq_len, tokenizer, bos)
