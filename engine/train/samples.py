"""Samples printed during training (train.sample_every), as nanoGPT does: a quick look at what
the model writes, next to its loss.

Every train.sample_every steps the loop decodes train.sample_prompt with engine.generate's
Generator from the live parameters, on the run's own mesh (the layout is the setup's in either
mode), and process 0 logs `step S sample: <text>`. The generator compiles at the first sample
step (logged); the key of step S's sample is seed S, so a Generator given the same prompt ids,
temperature, length, top-k (engine.generate's default, DEFAULT_TOP_K) and seed S reproduces it
from step S's checkpoint (engine.generate --seed=S).

engine/validation/samples.py refuses bad values at validation; `Sampler(run)` refuses a prompt the
tokenizer or the model's positions cannot take, before the workdir is written.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import logging

from engine.data.prompts import encode_prompts
from engine.generate import sampling as generate
from engine.errors import ConfigError
from engine.train.hooks import Hook
from engine.validation.samples import SAMPLE_TOKENS


def prompt_text(tokenizer, text: str) -> str:
  """train.sample_prompt; '' starts from the beginning-of-text id alone, or from a newline for a
  tokenizer without one (bytes, characters), so that every sample starts as a line does."""
  return '\n' if not text and tokenizer.bos_id is None else text


def new_tokens(config, prompt_len: int) -> int:
  """train.sample_tokens (0: SAMPLE_TOKENS, capped by GPT's learned positions), checked against
  the model's positions and sliding window."""
  model, asked = config.model, config.train.sample_tokens
  window = model.sliding_window if model.get('mla_kv_rank', 0) else 0  # Others compute it.
  limits = ([(model.max_len, 'GPT model\'s learned positions (model.max_len)')]
            if model.name == 'gpt' else [])
  limits += [(window, 'model\'s sliding window (model.sliding_window)')] if window else []
  room = min([limit for limit, _ in limits] + [prompt_len + SAMPLE_TOKENS]) - prompt_len
  for limit, what in limits:
    if prompt_len >= limit:
      raise ConfigError(
          f'train.sample_prompt={config.train.sample_prompt!r} takes {prompt_len} tokens, all '
          f'of the {what}: {limit}, leaving none to sample; shorten it.')
    if asked and prompt_len + asked > limit:
      raise ConfigError(
          f'train.sample_tokens={asked} with the {prompt_len} tokens of train.sample_prompt '
          f'exceeds the {what}: {limit}; give train.sample_tokens <= {limit - prompt_len} (0: '
          'what they leave).')
  return asked or room


class Sampler(Hook):
  """Decodes the prompt every train.sample_every steps (0: never) and logs the text; not at a
  preemption's step, which only checkpoints."""

  badput_cause = 'evaluation'

  def __init__(self, run):
    config = run.config
    self.every = config.train.sample_every
    if not self.every:
      return
    self.setup, self.tokenizer = run.setup, run.tokenizer
    self.text = prompt_text(self.tokenizer, config.train.sample_prompt)
    # Its ids after the beginning-of-text id, as every training document starts.
    self.prompt = encode_prompts(self.tokenizer, [self.text],
                                          what='train.sample_prompt')[0]
    self.new_tokens = new_tokens(config, len(self.prompt))
    # Among engine.generate's default top-k tokens, so that it reproduces the sample.
    self.sampling = generate.Sampling(temperature=config.train.sample_temperature,
                                      top_k=generate.DEFAULT_TOP_K)
    self.generator = None  # Built, and compiled, at the first sample step.

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def wants_sync(self, step: int, stopping: bool) -> bool:
    return self.due(step) and not stopping

  def at_sync(self, step: int, state, stopping: bool) -> None:
    if self.wants_sync(step, stopping):
      self(step, state['params'])

  def __call__(self, step: int, params) -> np.ndarray | None:
    """Step `step`'s sample from `params` (logged, and returned as ids), if it is due."""
    if not self.due(step):
      return None
    start = time.perf_counter()
    first = self.generator is None
    if first:
      logging.info('Compiling the sampler (train.sample_every=%d): %d prompt + %d new tokens.',
                   self.every, len(self.prompt), self.new_tokens)
      self.generator = generate.Generator(self.setup, len(self.prompt), self.new_tokens,
                                          self.sampling, self.tokenizer.vocab_size)
    ids = self.generator.generate(params, [self.prompt], self.new_tokens, seed=step,
                                  eos_id=self.tokenizer.eos_id)[0]
    if jax.process_index() == 0:
      if first:
        logging.info('Sampler compiled and run in %.1f s.', time.perf_counter() - start)
      logging.info('step %d sample: %r', step, self.text + self.tokenizer.decode(ids))
    return ids
