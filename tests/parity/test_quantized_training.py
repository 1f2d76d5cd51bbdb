"""int8 and fp8 projections (model.matmul_precision) in both modes on the suite's meshes (data,
fsdp, tensor, their mix, context, a 1F1B and a zero-bubble pipeline, experts) against the
single-device run of the same quantization, whose projections tests/unit/test_quantized_matmul.py
holds to NumPy's account; and that the quantization changes the run, so the comparison can
tell."""

import numpy as np
import pytest

from tests.parity.test_llama import llama_config
from tests.parity.test_moe import moe_config
from tests.parity.test_pipeline import _config as pipeline_config
from tests.support.helpers import _ungrouped, engine_run, single_device_run

pytestmark = pytest.mark.slow  # Every test here trains.

STEPS = 2
# A quantized run is exact only up to rounding ties: where float32 summation order moves a value
# across the midpoint between two quanta (the single device and a mesh add partial results in
# different orders), one element moves by a quantum, about 1 / 127 of its block's maximum. On
# these meshes that moved the losses by up to 4.8e-6, the gradient norms by 7.3e-5 (relative)
# and a first-step gradient by up to 1.1e-3 of its largest entry, against 7.9e-3 (int8) and
# 5.4e-2 (fp8) between the quantized and the unquantized run. Parameters after Adam's steps are
# not compared: an update divides by the gradient's running RMS, so a moved quantum in a
# near-zero gradient moves its update by up to the learning rate either way.
LOSS_ATOL, NORM_RTOL, GRADIENT_ATOL = 1e-5, 2e-4, 2e-3
# Divides every contraction a device holds on these meshes: the widths (32, 64) over tensor 8,
# and a sequence's 16 tokens in two zigzag pieces per device over context 2.
BLOCK = 4


def _assert_same_gradients(run, reference):
  for path, expected in reference.first_gradients.items():
    scale = max(float(np.abs(expected).max()), 1e-30)
    actual = _ungrouped(run.first_gradients[path], expected.shape)
    np.testing.assert_allclose(actual / scale, expected / scale, atol=GRADIENT_ATOL, rtol=0,
                               err_msg=f'gradient of {path}')


def _assert_same_quantized_run(run, reference):
  np.testing.assert_allclose(run.losses, reference.losses, atol=LOSS_ATOL, rtol=0)
  np.testing.assert_allclose(run.grad_norms, reference.grad_norms, rtol=NORM_RTOL, atol=0)
  _assert_same_gradients(run, reference)


def _quantized(config, precision):
  config.model.matmul_precision = precision
  config.model.matmul_block = BLOCK
  return config


@pytest.mark.parametrize('mode', ['manual', 'auto'])
@pytest.mark.parametrize('precision, mesh', [
    ('int8', (8, 1, 1)), ('int8', (1, 8, 1)), ('int8', (1, 1, 8)), ('int8', (2, 2, 2)),
    ('fp8', (2, 2, 2)), ('fp8', (1, 2, 4))],
    ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else v)
def test_llama_matches_single_device(precision, mesh, mode):
  reference = single_device_run(_quantized(llama_config(), precision), STEPS)
  _assert_same_quantized_run(engine_run(_quantized(llama_config(mesh), precision), mode, STEPS),
                             reference)


@pytest.mark.parametrize('mode', ['manual', 'auto'])
@pytest.mark.parametrize('schedule, mesh', [
    (None, (4, 1, 1, 2, 1)), ('1f1b', (2, 2, 1, 1, 2)), ('zb_h1', (2, 1, 2, 1, 2))],
    ids=['context', '1f1b', 'zb_h1'])
def test_gpt_context_and_pipelines_match_single_device(schedule, mesh, mode):
  """Context 2 (ring attention; a device holds each sequence as two pieces), and a stage-2
  pipeline of each new kind: the zero-bubble schedule takes the projections' weight gradients
  in a pass of their own."""
  config = _quantized(pipeline_config(mesh, 'gpt', 2, microbatches=2 if mesh[4] > 1 else 1),
                      'int8')
  if schedule:
    config.train.pipeline_schedule = schedule
  reference = single_device_run(_quantized(pipeline_config(model='gpt'), 'int8'), STEPS)
  _assert_same_quantized_run(engine_run(config, mode, STEPS), reference)


@pytest.mark.parametrize('mode', ['manual', 'auto'])
@pytest.mark.parametrize('mesh', [(2, 1, 1, 1, 1, 4), (1, 2, 2, 1, 1, 2)],
                         ids=['expert4_data2', 'expert2_fsdp2_tensor2'])
def test_capacity_experts_match_single_device(mesh, mode):
  """A mixture of experts with the capacity dispatch, whose experts' matmuls are quantized too
  (4 slots per expert and sequence: one block), its auxiliary losses included."""
  reference = single_device_run(_quantized(moe_config(dispatch='capacity'), 'int8'), STEPS)
  config = _quantized(moe_config(mesh, 'capacity', mode), 'int8')
  _assert_same_quantized_run(engine_run(config, mode, STEPS), reference)


@pytest.mark.parametrize('precision', ['int8', 'fp8'])
def test_quantization_changes_the_run_by_far_more_than_the_tolerance(precision):
  """Far enough from the unquantized run for the gradient check above to fail on a mode that
  skipped the quantization, and near enough to train: within 1 % of its loss."""
  plain = single_device_run(llama_config(), STEPS)
  quantized = single_device_run(_quantized(llama_config(), precision), STEPS)
  with pytest.raises(AssertionError):
    _assert_same_gradients(quantized, plain)
  np.testing.assert_allclose(quantized.losses, plain.losses, rtol=0.01)
