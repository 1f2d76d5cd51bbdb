"""The narrow seams between models, layouts and the loop, held in numbers, and the three kinds of
addition they are for, each added here in a fixture as a real one would be:

- a logger: one module (a class here) and one line in engine/loggers/'s LOGGERS;
- an attention option: one field of the AttentionSpec, read by the attention paths that compute
  it (here it goes through the spec's own `capped`, which every path calls), the spec built by
  the family's registry entry;
- an adapter: the model's spec only (which parameters train), honoured by both modes' steps and
  the optimizer with nothing else changed.

Each also asserts the files a real addition of its kind changes, read from the source, so that
a new dependency on a logger, a spec field or LoRA outside them fails here."""

import ast
import dataclasses
import inspect
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from engine import loggers, models, parallel
from engine.assemble import lay_out
from engine.loggers.base import Logger
from engine.models import gpt
from engine.generate.sampling import Generator
from engine.models.attention import causal
from engine.models.attention.spec import AttentionSpec
from engine.models.llama import spec as llama_spec
from engine.models.ops import LocalOps
from engine.parallel import auto, context, decode, manual_ops
from engine.parallel.decode import build_decode_steps
from engine.train.loop import train
from tests.support.helpers import ATOL, tiny_config, train_batches
from tests.unit.test_architecture import ENGINE, GRAPH, _strings

pytestmark = pytest.mark.slow


def _modules_directly_in(folder: str) -> list[str]:
  return sorted(p.name for p in (ENGINE / folder).glob('*.py'))


def _engine_imports(module: str) -> set[str]:
  """The engine modules `module` imports, less the packages that only contain them."""
  imported = GRAPH[module]
  return {m for m in imported if not any(other.startswith(m + '.') for other in imported)}


def test_the_tree_and_the_seams_hold_their_numbers():
  assert len(_modules_directly_in('models')) <= 16, _modules_directly_in('models')
  assert len(_modules_directly_in('analysis')) <= 8, _modules_directly_in('analysis')
  assert (ENGINE / 'parallel' / 'pipeline' / 'one_f_one_b.py').exists()
  assert not [m for m in _modules_directly_in('parallel') if 'pipeline' in m or 'stage' in m]
  loop = _engine_imports('engine.train.loop')
  assert 'engine.workdir.resume' in loop and len(loop) <= 16, sorted(loop)
  entry_points = [LocalOps.attention, auto.AutoOps.attention, manual_ops.ManualOps.attention,
                  decode.DecodeOps.attention, causal.causal_attention, context.ring_attention]
  wide = {f.__qualname__: len(inspect.signature(f).parameters) for f in entry_points
          if len(inspect.signature(f).parameters) > 6}
  assert not wide, wide


def test_no_module_of_the_layouts_or_the_workdir_names_lora():
  named = sorted(str(p.relative_to(ENGINE.parent)) for folder in ('parallel', 'workdir')
                 for p in (ENGINE / folder).rglob('*.py') if 'lora' in p.read_text().lower())
  assert not named, named


# --- A logger: one module, one registry line. -------------------------------------------------


class ToyLogger(Logger):
  """Keeps what it is given (a real one would write it somewhere)."""
  made = []

  def __init__(self, workdir, start_step, config):
    super().__init__(workdir, start_step, config)
    self.records, self.closed, self.summary = [], False, None
    ToyLogger.made.append(self)

  def write(self, step, scalars):
    self.records.append({'step': step, **scalars})

  def close(self):
    self.closed = True

  def end_run(self, summary):
    self.summary = summary


def test_a_toy_logger_is_one_module_and_one_registry_line(tmp_path, monkeypatch):
  monkeypatch.setitem(loggers.LOGGERS, 'toy', ToyLogger)  # The one line.
  config = tiny_config(mesh=(-1, 1, 1), steps=4)
  config.train.loggers = 'jsonl,toy'
  result = train(config, str(tmp_path / 'run'))
  (toy,) = ToyLogger.made
  written = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').open()]
  assert toy.records == written and len(written) == 5  # Four train points and one eval.
  assert toy.closed and toy.summary == result.summary and toy.summary['final_step'] == 4
  # What a real one changes: its module and the registry. Nothing else imports a logger's
  # module, and the writer names none.
  logger_modules = {m for m in GRAPH
                    if m.startswith('engine.loggers.') and m != 'engine.loggers.base'}
  importers = {m for m, children in GRAPH.items() if children & logger_modules}
  assert importers == {'engine.loggers'}, importers
  writer = ast.parse((ENGINE / 'train' / 'metrics.py').read_text())
  code = _strings(ENGINE / 'train' / 'metrics.py') + [
      getattr(node, 'id', getattr(node, 'attr', '')) for node in ast.walk(writer)]
  assert not [text for text in code if re.search(r'wandb|tensorboard|jsonl|JsonLines', text,
                                                 re.IGNORECASE)]


# --- An attention option: one field of the spec, and the paths that compute it. ----------------


@dataclasses.dataclass(frozen=True)
class ToySpec(AttentionSpec):
  """A temperature on the attention logits: softmax(logits / t)."""
  temperature: float = 1.0

  def capped(self, logits):
    return super().capped(logits / self.temperature)


def _llama_config(context_size=1, mode='auto'):
  config = tiny_config()
  config.model.name, config.model.num_kv_heads = 'llama', 2
  config.mesh.context, config.parallelism.mode = context_size, mode
  config.data.global_batch_size = 8
  return config


def _with_attention(spec: AttentionSpec, build):
  """`build()` while the family's registry entry gives every layer `spec` (as it would build
  one from a real option's key)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(llama_spec, 'attention', lambda model_config: spec)
    return build()


def test_a_toy_attention_option_reaches_every_path_through_the_spec():
  """With temperature 2 every path equals the plain attention at half the logits' scale: the
  whole sequence (einsum), ring attention over a sequence split in two (manual mode), and the
  generation cache's prefill."""
  config = _llama_config()
  corpus, batches = train_batches(config)
  vocab, tokens = corpus.tokenizer.vocab_size, jnp.asarray(batches[0])
  toy = ToySpec(temperature=2.0)
  create = lambda spec: _with_attention(
      spec, lambda: models.build(config.model, vocab).create(nnx.Rngs(params=0)))
  toy_model = create(toy)
  params = nnx.to_pure_dict(nnx.state(toy_model, nnx.Param))
  for weight in ('w_q_DHK', 'w_k_DNK'):  # Sharp attention, so that its scale shows in the loss.
    params['blocks'][weight] = params['blocks'][weight] * 8.0
  nnx.update(toy_model, nnx.State(params))
  head_size = config.model.embed_dim // config.model.num_heads
  logits = {}
  for name, spec in (('half', AttentionSpec(scale=0.5 * head_size ** -0.5)),
                     ('plain', AttentionSpec())):
    model = create(spec)
    nnx.update(model, nnx.State(params))
    logits[name] = np.asarray(model(tokens[:, :-1]))
  np.testing.assert_allclose(toy_model(tokens[:, :-1]), logits['half'], atol=ATOL, rtol=0)
  assert np.abs(logits['plain'] - logits['half']).max() > 100 * ATOL  # The option does something.

  ring = _llama_config(context_size=2, mode='manual')
  setup = _with_attention(toy, lambda: lay_out(ring, vocab, jax.devices()[:2]))
  placed = jax.device_put(params, jax.tree.map(lambda s: s.sharding,
                                               setup.abstract_state()['params']))
  loss = float(parallel.build_steps('manual', setup).eval(
      placed, jax.device_put(batches[0], setup.batch_sharding())))
  expected = float(optax.softmax_cross_entropy_with_integer_labels(
      logits['half'], np.asarray(tokens[:, 1:])).mean())
  assert abs(loss - expected) < ATOL, (loss, expected)
  plain = float(optax.softmax_cross_entropy_with_integer_labels(
      logits['plain'], np.asarray(tokens[:, 1:])).mean())
  assert abs(plain - expected) > 20 * ATOL, (plain, expected)  # A bug the check would see.

  prompt = 6
  one = _with_attention(toy, lambda: lay_out(config, vocab, jax.devices()[:1]))
  generator = Generator(one, prompt, 2)
  steps = build_decode_steps(one, generator._empty_cache, lambda logits_BV, key: logits_BV)
  _, first = steps.prefill(params, np.asarray(tokens[:2, :prompt]), np.full(2, prompt, np.int32),
                           jax.random.key(0))
  np.testing.assert_allclose(first, logits['half'][:2, prompt - 1], atol=ATOL, rtol=0)


def test_the_spec_fields_are_read_by_the_attention_paths_alone():
  """What a real option changes besides the spec and its key: the paths that compute it (and
  validation where they cannot). Today's fields are read nowhere else."""
  fields = {f.name for f in dataclasses.fields(AttentionSpec)}
  readers = set()
  for path in ENGINE.rglob('*.py'):
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr in fields and
          isinstance(node.value, ast.Name) and node.value.id in ('spec', 'self') and
          (node.value.id == 'spec' or path.name == 'spec.py' and 'attention' in path.parts)):
        readers.add(str(path.relative_to(ENGINE.parent)))
  assert readers == {'engine/models/attention/spec.py', 'engine/models/attention/causal.py',
                     'engine/parallel/context.py', 'engine/parallel/auto.py',
                     'engine/models/llama/model.py'}, readers


# --- An adapter: the model's spec only. --------------------------------------------------------


def _norms_only(model_config, vocab_size):
  """GPT with only its layer norms trained (BitFit-style): the spec marks them, nothing else."""
  return dataclasses.replace(gpt.build(model_config, vocab_size),
                             trainable=lambda path: '/ln_' in f'/{path}')


@pytest.fixture
def norms_only():
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(models.MODELS, 'norms_only', _norms_only)
    yield


def _masked_reference(config, batches, steps):
  """(parameters, gradient norms) of one device, plain optax: gradients of the frozen parameters
  zeroed before the norm, AdamW on the trained ones only."""
  model = models.build(config.model, 256).create(nnx.Rngs(params=jax.random.key(config.seed)))
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  trains = lambda path: '/ln_' in f'/{path}'
  labels = jax.tree_util.tree_map_with_path(
      lambda keys, _: 't' if trains('/'.join(str(k.key) for k in keys)) else 'f', params)
  from engine.optimizer import make_optimizer  # pylint: disable=g-import-not-at-top
  adam = make_optimizer(config.optim, config.train.num_steps).tx
  tx = optax.chain(optax.clip_by_global_norm(config.optim.grad_clip_norm),
                   optax.multi_transform({'t': adam, 'f': optax.set_to_zero()}, labels))
  state = tx.init(params)

  def loss(p, tokens):
    logits = nnx.merge(graphdef, p)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()

  norms = []
  for i in range(steps):
    grads = jax.grad(loss)(params, jnp.asarray(batches[i]))
    grads = jax.tree.map(lambda g, l: g if l == 't' else jnp.zeros_like(g), grads, labels)
    norms.append(float(optax.tree.norm(grads)))
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, norms


@pytest.mark.parametrize('mode', ['auto', 'manual'])
def test_a_toy_adapter_is_the_models_spec_only(norms_only, mode):
  config = tiny_config(mesh=(2, 2, 2))
  config.model.name, config.parallelism.mode = 'norms_only', mode
  corpus, batches = train_batches(config)
  setup = lay_out(config, corpus.tokenizer.vocab_size)
  step = jax.jit(parallel.build_steps(mode, setup).train)
  state, _ = setup.init(config.seed)
  before, norms = jax.device_get(state['params']), []
  for i in range(2):
    state, metrics = step(state, jax.device_put(batches[i], setup.batch_sharding()))
    norms.append(float(metrics['grad_norm']))
  after = jax.device_get(state['params'])
  reference, reference_norms = _masked_reference(config, batches, 2)
  # The frozen parameters' gradients are not in the norm (nor computed).
  np.testing.assert_allclose(norms, reference_norms, rtol=ATOL)
  flat = lambda tree: {jax.tree_util.keystr(k): np.asarray(v)
                       for k, v in jax.tree_util.tree_leaves_with_path(tree)}
  before, after, reference = flat(before), flat(after), flat(reference)
  for path in after:
    if "['ln_" in path:
      assert not np.array_equal(after[path], before[path]), path
      np.testing.assert_allclose(after[path], reference[path], atol=1e-4, rtol=0, err_msg=path)
    else:
      np.testing.assert_array_equal(after[path], before[path], err_msg=path)
  # No optimizer moments for the frozen parameters.
  moments = sum(x.size for x in jax.tree.leaves(state['opt_state']) if x.ndim)
  norms = sum(v.size for p, v in after.items() if "['ln_" in p)
  assert moments == 2 * norms, (moments, norms)
