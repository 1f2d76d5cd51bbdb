"""A finished run as an lm-eval model (the `lm_eval` extra): lm-eval's TemplateLM with its three
request types answered by the engine. Log-likelihoods come from engine/lm_eval/scoring.py (the
run's forward pass on its mesh), rolling log-likelihoods from the same on lm-eval's own
disjoint windows, and generations from engine.generate's Generator (greedy, the key/value cache),
cut at the first of the request's stop strings. Contexts and continuations are tokenized as
lm-eval tokenizes them for a Hugging Face model (TemplateLM._encode_pair: trailing spaces of the
context moved to the continuation; no special tokens added).

`engine_lm(workdir, mesh, batch)` builds one; lm-eval itself is imported only here.
"""

from __future__ import annotations

from engine.generate.sampling import Generator, Sampling, load_run
from engine.lm_eval.scoring import Scorer


def engine_lm(workdir: str, mesh: str = '1x1x1', batch: int = 8):
  """The run in `workdir` as an `lm_eval.api.model.TemplateLM`."""
  from lm_eval import utils  # pylint: disable=g-import-not-at-top
  from lm_eval.api.model import TemplateLM  # pylint: disable=g-import-not-at-top

  run, params = load_run(workdir, mesh)
  tokenizer, window = run.tokenizer, run.config.data.seq_len

  class EngineLM(TemplateLM):
    """A training run of the engine, scored and sampled on its own compiled programs."""

    def __init__(self):
      super().__init__()
      self.scorer = Scorer(run.setup, params, window, batch)
      self.generators = {}

    @property
    def eot_token_id(self) -> int:
      return tokenizer.eos_id if tokenizer.eos_id is not None else 0

    @property
    def prefix_token_id(self) -> int:
      return tokenizer.bos_id if tokenizer.bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
      return f'engine-{tokenizer.kind}'

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
      del add_special_tokens, kwargs
      return [int(i) for i in tokenizer.encode(string)]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
      del disable_tqdm, kwargs
      results = self.scorer.continuations([(context, continuation)
                                           for _, context, continuation in requests])
      for (key, _, _), result in zip(requests, results):
        self.cache_hook.add_partial('loglikelihood', key, result)
      return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
      totals = []
      for (text,) in [r.args for r in requests]:
        windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
            token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
            max_seq_len=window, context_len=1)]
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
        prompt = self.tok_encode(context)[-window:] or [self.prefix_token_id]
        generator = self._generator(len(prompt), new_tokens)
        ids = generator.generate(params, [prompt], new_tokens, 0, tokenizer.eos_id)[0]
        text = tokenizer.decode([i for i in ids if i != tokenizer.eos_id])
        for stop in until:
          text = text.split(stop, 1)[0]
        outputs.append(text)
        self.cache_hook.add_partial('generate_until', (context, kwargs), text)
      return outputs

    def _generator(self, prompt_len: int, new_tokens: int) -> Generator:
      """A Generator per (prompt length rounded up to a power of two, new tokens)."""
      slots = 1 << max(prompt_len - 1, 0).bit_length()
      key = (slots, new_tokens)
      if key not in self.generators:
        self.generators[key] = Generator(run.setup, slots, new_tokens, Sampling(),
                                         tokenizer.vocab_size)
      return self.generators[key]

  return EngineLM()
