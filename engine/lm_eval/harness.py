"""A finished run as an lm-eval model (the `lm_eval` extra): lm-eval's TemplateLM with its three
request types answered by the engine. Log-likelihoods come from engine/lm_eval/scoring.py (the
run's forward pass on its mesh), rolling log-likelihoods from the same on lm-eval's own
disjoint windows, and generations from engine.generate's Generator (greedy, the key/value cache),
cut at the first of the request's stop strings. Contexts and continuations are tokenized as
lm-eval tokenizes them for a Hugging Face model (TemplateLM._encode_pair: trailing spaces of the
context moved to the continuation; no special tokens added).

Imports lm-eval: only the command imports this module, once it has checked that lm-eval is
installed.
"""

from __future__ import annotations

from lm_eval import utils
from lm_eval.api.model import TemplateLM

from engine.generate.sampling import Generator, Sampling, load_run
from engine.lm_eval.scoring import Scorer


class EngineLM(TemplateLM):
  """The training run in `workdir`, scored and sampled on its own compiled programs on `mesh`,
  `batch` log-likelihood requests per call."""

  def __init__(self, workdir: str, mesh: str = '1x1x1', batch: int = 8):
    super().__init__()
    self.run, self.params = load_run(workdir, mesh)
    self.tok = self.run.tokenizer
    self.window = self.run.config.data.seq_len
    self.scorer = Scorer(self.run.setup, self.params, self.window, batch)
    self.generators = {}

  @property
  def eot_token_id(self) -> int:
    return self.tok.eos_id if self.tok.eos_id is not None else 0

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

  @property
  def tokenizer_name(self) -> str:
    return f'engine-{self.tok.kind}'

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs
    return [int(i) for i in self.tok.encode(string)]

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    del disable_tqdm, kwargs
    results = self.scorer.continuations([(context, continuation)
                                         for _, context, continuation in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    totals = []
    for (text,) in [r.args for r in requests]:
      windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
          max_seq_len=self.window, context_len=1)]
      totals.append(sum(logprob for logprob, _ in self.scorer.continuations(windows)))
      self.cache_hook.add_partial('loglikelihood_rolling', (text,), totals[-1])
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    outputs = []
    for request in requests:
      context, kwargs = request.args
      until = kwargs.get('until') or []
      until = [until] if isinstance(until, str) else list(until)
      new_tokens = int(kwargs.get('max_gen_toks', 256))
      prompt = self.tok_encode(context)[-self.window:] or [self.prefix_token_id]
      ids = self._generator(len(prompt), new_tokens).generate(
          self.params, [prompt], new_tokens, 0, self.tok.eos_id)[0]
      text = self.tok.decode([i for i in ids if i != self.tok.eos_id])
      for stop in until:
        text = text.split(stop, 1)[0]
      outputs.append(text)
      self.cache_hook.add_partial('generate_until', (context, kwargs), text)
    return outputs

  def _generator(self, prompt_len: int, new_tokens: int) -> Generator:
    """A Generator per (prompt length rounded up to a power of two, new tokens)."""
    slots = 1 << max(prompt_len - 1, 0).bit_length()
    if (slots, new_tokens) not in self.generators:
      self.generators[slots, new_tokens] = Generator(self.run.setup, slots, new_tokens,
                                                     Sampling(), self.tok.vocab_size)
    return self.generators[slots, new_tokens]
