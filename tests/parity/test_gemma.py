"""Gemma's options on the Llama (engine/models/formats/gemma.py: norms after each sublayer, GeGLU,
the scaled embedding, both soft caps, every other layer global with its own rotary, the local
layers' sliding window shorter than the sequence) in training: the train steps of both modes on
tensor and FSDP splits, a sequence split and pipeline schedules (each layer's number carried
through the stages) against the model's own single-device run (tests/unit/test_hf_gemma.py
checks the arithmetic against transformers' in NumPy).
"""

import numpy as np
import pytest

from tests.support.helpers import ATOL, assert_same_run, engine_run, single_device_run, tiny_config

STEPS = 2


def gemma_config(mesh=(1, 1, 1), context=1, stage=1, microbatches=1, schedule='', repeats=1):
  config = tiny_config(mesh=mesh, steps=STEPS)
  config.mesh.context, config.mesh.stage = context, stage
  config.train.microbatches, config.train.pipeline_schedule = microbatches, schedule
  config.train.pipeline_repeats = repeats
  model = config.model
  model.name, model.num_layers, model.num_kv_heads = 'llama', 4, 2
  model.tie_embeddings = False
  # Weights and a logit scale large enough that the attention is far from uniform: its query
  # and key gradients then do not come from cancellation, which Adam's first step would turn
  # from float32 noise into differences of the learning rate.
  model.update(post_norms=True, mlp_activation='gelu_tanh', embed_scale=True, global_every=2,
               rope_local_base=100.0, sliding_window=5, attention_scale=1.0,
               attention_softcap=2.0, logit_softcap=0.5, init_std=0.05)
  return config


@pytest.fixture(scope='module')
def reference():
  return single_device_run(gemma_config(), STEPS)


@pytest.mark.slow
@pytest.mark.parametrize('mode, mesh, context, stage, microbatches, schedule, repeats', [
    ('manual', (2, 2, 2), 1, 1, 1, '', 1),
    ('auto', (2, 2, 1), 2, 1, 1, '', 1),
    ('auto', (2, 1, 2), 1, 2, 2, '', 1),
    ('manual', (2, 2, 1), 1, 2, 4, 'interleaved_1f1b', 2),
], ids=['manual-2x2x2', 'auto-context', 'auto-gpipe', 'manual-interleaved-1f1b'])
def test_train_steps_match_one_device(mode, mesh, context, stage, microbatches, schedule,
                                      repeats, reference):
  config = gemma_config(mesh, context, stage, microbatches, schedule, repeats)
  assert_same_run(engine_run(config, mode, STEPS), reference)


@pytest.mark.parametrize('change', [{'sliding_window': 0}, {'rope_local_base': 0.0},
                                    {'attention_softcap': 0.0}, {'logit_softcap': 0.0}],
                         ids=lambda change: next(iter(change)))
def test_the_options_change_the_run(reference, change):
  """Without each option the first step's gradients differ by far more than the comparisons'
  tolerance (relative to each gradient's scale, as they compare), so those see it."""
  config = gemma_config()
  config.model.update(change)
  plain = single_device_run(config, 1)
  gap = max(np.abs(plain.first_gradients[path] - gradient).max() / np.abs(gradient).max()
            for path, gradient in reference.first_gradients.items())
  assert gap > 100 * ATOL, (change, gap)
