"""train.sample_every: samples logged at the chosen steps, of the chosen length, equal to what
engine.generate's Generator writes from the run's final checkpoint (loaded on one device, an
independent path); in auto mode on a 2x2x2 mesh and in manual mode; off by default; refused
with several processes."""

import logging

import numpy as np
import pytest

from engine import validation
from engine.train import samples as train_samples
from engine.assemble import assemble
from engine.config import default_config
from engine.errors import ConfigError
from engine.generate.sampling import DEFAULT_TOP_K, Generator, Sampling, load_run
from engine.train.loop import train
from tests.support.helpers import tiny_config

STEPS, EVERY = 4, 2


def _sampled_run(workdir, mode, temperature):
  """A 4-step run sampling every 2 steps from '' (a newline: bytes have no beginning-of-text
  token): its logged sample lines and the ids each sample step returned."""
  config = tiny_config(mesh=(2, 2, 2), steps=STEPS)
  config.parallelism.mode = mode
  config.train.sample_every = EVERY
  config.train.sample_temperature = temperature
  returned = {}
  original = train_samples.Sampler.__call__

  def recording(self, step, params):
    ids = original(self, step, params)
    if ids is not None:
      returned[step] = ids
    return ids

  handler = _Lines()
  logger = logging.getLogger('absl')
  logger.addHandler(handler)
  old_level = logger.level
  logger.setLevel(logging.INFO)  # Earlier tests may quiet absl's.
  try:
    with pytest.MonkeyPatch.context() as patch:
      patch.setattr(train_samples.Sampler, '__call__', recording)
      train(config, str(workdir))
  finally:
    logger.removeHandler(handler)
    logger.setLevel(old_level)
  return handler.lines, returned


class _Lines(logging.Handler):

  def __init__(self):
    super().__init__()
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


@pytest.fixture(scope='module', params=[('auto', 0.8), ('manual', 0.0)], ids=['auto', 'manual'])
def sampled(request, tmp_path_factory):
  workdir = tmp_path_factory.mktemp(request.param[0])
  return (workdir, request.param[1]) + _sampled_run(workdir, *request.param)


@pytest.mark.slow
def test_samples_at_the_chosen_steps_match_the_checkpoints_generator(sampled):
  workdir, temperature, lines, returned = sampled
  samples = [line for line in lines if ' sample: ' in line]
  assert [line.split(' sample: ')[0] for line in samples] == ['step 2', 'step 4'], samples
  assert sum('Compiling the sampler' in line for line in lines) == 1, lines
  # model.max_len=16 learned positions, 1 of them the newline prompt: 15 new tokens (no end of
  # text token to stop earlier).
  assert sorted(returned) == [2, 4] and all(len(ids) == 15 for ids in returned.values())
  run, params = load_run(str(workdir), '1x1x1')
  prompt = np.array([ord('\n')], np.int32)
  generator = Generator(run.setup, 1, 15, Sampling(temperature, top_k=DEFAULT_TOP_K),
                        run.tokenizer.vocab_size)
  expected = generator.generate(params, [prompt], 15, seed=STEPS)[0]
  np.testing.assert_array_equal(returned[STEPS], expected)
  text = '\n' + run.tokenizer.decode(expected)
  assert samples[-1] == f'step 4 sample: {text!r}', samples


def test_sampling_is_off_by_default():
  assert default_config().train.sample_every == 0
  sampler = train_samples.Sampler(assemble(tiny_config(mesh=(8, 1, 1))))
  assert not any(sampler.due(step) for step in range(1, 1000))
  assert sampler(100, params=None) is None  # Nothing is built or run.


def test_several_processes_are_refused_in_training_only():
  config = tiny_config(mesh=(8, 1, 1))
  config.train.sample_every = 2
  with pytest.raises(ConfigError, match=r'^train.sample_every=2 with 2 processes: samples during '
                     'training run on one process only; set it to 0'):
    validation.validate(config, 8, 2, 1)
  validation.validate(config, 8, 2, 1, training=False)  # A finished run's generation, export.
