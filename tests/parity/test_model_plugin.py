"""A second, deliberately different language model plugs in from this file alone.

`MixerLM` shares nothing with engine/models/gpt.py: it has no attention (tokens mix through a
causal running mean), its layers are a Python list rather than a scanned stack, it is built from
Flax's standard layers (`nnx.Embed`, `nnx.Linear`, `nnx.RMSNorm`), and its parameters are named the
way the Flax docs do it, with `nnx.with_partitioning` on the initialisers. It is registered in
`engine.models.MODELS` here, with no engine file changed, and must then shard by the rules and
train in both modes on a 2x2x2 mesh exactly like its single-device run, while the communication
theory accounts for its collectives from its spec alone.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine import models
from engine.analysis.compare import comparison
from engine.models.ops import LocalOps
from engine.models.spec import ModelSpec
from engine.assemble import assemble, lay_out
from engine.errors import ConfigError
from tests.support.helpers import assert_same_run, engine_run, single_device_run, tiny_config

STEPS = 3


def _init(logical_axes, base=nnx.initializers.normal(0.02)):
  return nnx.with_partitioning(base, logical_axes)


class MixerBlock(nnx.Module):
  """Causal token mixing by a running mean over past positions, then a Megatron MLP: the up
  projection is column-parallel, the down projection row-parallel (no bias before the sum)."""

  def __init__(self, width: int, hidden: int, rngs: nnx.Rngs):
    self.norm = nnx.RMSNorm(width, scale_init=_init(('norm',), nnx.initializers.ones_init()),
                            rngs=rngs)
    self.up = nnx.Linear(width, hidden, kernel_init=_init(('embed', 'mlp')),
                         bias_init=_init(('mlp',), nnx.initializers.zeros_init()), rngs=rngs)
    self.down = nnx.Linear(hidden, width, use_bias=False, kernel_init=_init(('mlp', 'embed')),
                           rngs=rngs)

  def __call__(self, x_BLD, ops):
    positions_L1 = jnp.arange(1, x_BLD.shape[1] + 1, dtype=x_BLD.dtype)[:, None]
    mean_BLD = jnp.cumsum(x_BLD, axis=1) / positions_L1
    h_BLF = ops.constrain(jax.nn.gelu(self.up(self.norm(mean_BLD))), ('batch', 'length', 'mlp'))
    return x_BLD + ops.finish_contraction(self.down(h_BLF), 'mlp')


class MixerLM(nnx.Module):

  def __init__(self, vocab: int, width: int, hidden: int, num_layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, width, embedding_init=_init(('vocab', 'embed')), rngs=rngs)
    self.blocks = nnx.List([MixerBlock(width, hidden, rngs) for _ in range(num_layers)])
    self.norm = nnx.RMSNorm(width, rngs=rngs)  # Unannotated: replicated everywhere.
    self.head = nnx.Linear(width, vocab, use_bias=False, kernel_init=_init(('embed', 'vocab')),
                           rngs=rngs)

  def __call__(self, tokens_BL, ops=LocalOps()):
    x_BLD = ops.constrain(ops.embed_lookup(self.embed.embedding[...], tokens_BL),
                          ('batch', 'length', 'embed'))
    for block in self.blocks:
      x_BLD = ops.constrain(block(x_BLD, ops), ('batch', 'length', 'embed'))
    return ops.constrain(self.head(self.norm(x_BLD)), ('batch', 'length', 'vocab'))


def build_mixer(model_config, vocab_size: int) -> ModelSpec:
  D, F, layers = model_config.embed_dim, model_config.mlp_dim, model_config.num_layers
  return ModelSpec(
      name='mixer', factory=lambda rngs: MixerLM(vocab_size, D, F, layers, rngs),
      vocab_size=vocab_size, embed_dim=D, num_layers=layers, row_parallel_per_layer=('mlp',),
      flops_per_token=lambda seq_len: 6.0 * (layers * 2 * D * F + vocab_size * D))


@pytest.fixture(scope='module', autouse=True)
def registered():
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(models.MODELS, 'mixer', build_mixer)
    yield


def _config(mesh=(1, 1, 1)):
  config = tiny_config(mesh=mesh, steps=STEPS)
  config.model.name = 'mixer'
  return config


@pytest.fixture(scope='module')
def reference():
  return single_device_run(_config(), STEPS)


def test_flax_partitioning_metadata_drives_the_layout():
  specs = {p.path: p.spec for p in assemble(_config((2, 2, 2))).setup.parameters()}
  assert specs['embed/embedding'] == P('tensor', 'fsdp')
  assert specs['blocks/0/up/kernel'] == P('fsdp', 'tensor')
  assert specs['blocks/1/up/bias'] == P('tensor')
  assert specs['blocks/0/down/kernel'] == P('tensor', 'fsdp')
  assert specs['head/kernel'] == P('fsdp', 'tensor')
  assert specs['norm/scale'] == P(None)


def test_muon_takes_the_matrices_by_their_logical_names():
  config = _config()
  config.optim.name = 'muon'
  setup = lay_out(config, 256, jax.devices()[:1])
  dims = dict(_flat_dims(setup.optimizer.matrix_dims))
  assert {path for path, d in dims.items() if d is not None} == {
      f'blocks/{i}/{name}/kernel' for i in range(2) for name in ('up', 'down')}


def test_muon_on_a_model_without_named_matrices_is_refused():
  """Flax's layers without partitioning metadata: no dimension names, so no matrices."""
  def build_unnamed(model_config, vocab_size):
    D = model_config.embed_dim
    factory = lambda rngs: nnx.Sequential(nnx.Embed(vocab_size, D, rngs=rngs),
                                          nnx.Linear(D, vocab_size, rngs=rngs))
    return ModelSpec(name='unnamed', factory=factory, vocab_size=vocab_size, embed_dim=D,
                     num_layers=0, row_parallel_per_layer=(),
                     flops_per_token=lambda seq_len: 6.0 * 2 * vocab_size * D)

  config = _config()
  config.model.name, config.optim.name = 'unnamed', 'muon'
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(models.MODELS, 'unnamed', build_unnamed)
    with pytest.raises(ConfigError, match="model 'unnamed' has no parameter Muon takes"):
      lay_out(config, 256, jax.devices()[:1])


def _flat_dims(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or isinstance(
      x, tuple))[0]
  return [('/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path), leaf)
          for path, leaf in leaves]


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_trains_like_its_single_device_run_on_2x2x2(mode, reference):
  assert_same_run(engine_run(_config((2, 2, 2)), mode, STEPS), reference)


@pytest.mark.slow
def test_compare_report_and_theory_need_no_parameter_names(tmp_path):
  report = comparison.compare(_config((2, 2, 2)), str(tmp_path), ['manual'], steps=1, warmup=0)
  assert 'manual: AGREES' in report['verdict']
  ratios = {(r['kind'], r['axes']): r['manual']['ratio'] for r in report['communication']}
  # Every collective the theory predicts from the spec is there, in the predicted amount.
  for key in [('all-gather', 'fsdp'), ('reduce-scatter', 'fsdp'), ('all-reduce', 'data'),
              ('all-reduce', 'tensor')]:
    assert ratios[key] == pytest.approx(1.0, abs=0.02), (key, ratios)
