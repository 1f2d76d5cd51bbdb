"""Tiny configs, and runs of the engine and of the single-device reference that must agree."""

from concurrent import futures
import dataclasses

import jax
import numpy as np
import optax
import pytest
from optax.contrib import MuonState

from engine import data, models, parallel
from engine.analysis import collectives
from engine.analysis.reference import ReferenceRun
from engine.config import default_config
from engine.assemble import lay_out, resolve_vocab_size
from engine.train.loop import train
from tests.support import reference_envs

# Float32 sums taken in another order (per-shard partial sums, then all-reduces) differ by a few
# ulps per operation: losses, gradient norms and every gradient (relative to its largest entry)
# agree to 1e-5 (measured: gradients within 1.1e-8 absolute). A layout bug is orders of
# magnitude larger: a gradient summed instead of averaged over 8 devices is 8x the reference.
ATOL = 1e-5
# Parameters are looser: Adam divides each update by the gradient's running RMS, so an entry
# whose gradient is near zero turns float32 noise in it into an update off by a few % of the
# learning rate (3e-3 in the tiny configs; measured up to 2.7e-5 after 2 steps). 1e-4 still
# catches a missing or misdirected update (>= one learning rate); the gradients carry the
# strict check.
PARAM_ATOL = 1e-4


def tiny_config(mesh=(1, 1, 1), steps=4, source='synthetic'):
  """A 2-layer width-32 GPT on synthetic text: small enough for many compiles on 2 cores."""
  c = default_config()
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.embed_dim = 32
  c.model.mlp_dim = 64
  c.model.max_len = 16
  c.data.source = source
  c.data.seq_len = 16
  c.data.global_batch_size = 16
  c.data.synthetic_tokens = 20_000
  c.optim.warmup_steps = 0  # Every step moves the parameters.
  c.optim.learning_rate = 3e-3
  c.train.num_steps = steps
  c.train.log_every = 1
  c.train.eval_every = steps
  c.train.eval_batches = 2
  c.train.checkpoint_every = steps
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


@dataclasses.dataclass
class Run:
  """What a few optimizer steps produced, by whichever computation."""
  losses: np.ndarray  # Per step, before its update.
  grad_norms: np.ndarray  # Per step, before clipping.
  first_gradients: dict[str, np.ndarray]  # Every parameter's gradient at step 1, by path.
  params: dict[str, np.ndarray]  # After the last step, by path.


def _flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): np.asarray(value)
          for path, value in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def train_batches(config):
  """(corpus, the engine's stream of global batches) of a config, in one process."""
  corpus = data.load_corpus(config.data, config.seed)
  return corpus, data.batches(corpus, config.data, 'train', config.data.global_batch_size,
                              config.seed, 0, 1)


_REFERENCE_RUNS = {}


def single_device_run(config, num_steps) -> Run:
  """`num_steps` steps of engine.analysis.reference on the engine's batch stream.

  Computed once per session for each (model, optimizer, data, seed, steps): several test files
  compare against the same run. It reads nothing else of the config (the mesh, the mode)."""
  key = (config.model.to_json(), config.optim.to_json(), config.data.to_json(), config.seed,
         config.train.num_steps, num_steps)
  if key not in _REFERENCE_RUNS:
    _REFERENCE_RUNS[key] = _single_device_run(config, num_steps)
  return _REFERENCE_RUNS[key]


def _single_device_run(config, num_steps) -> Run:
  corpus, batches = train_batches(config)
  vocab = resolve_vocab_size(config.model, corpus.tokenizer.vocab_size)
  run = ReferenceRun(models.build(config.model, vocab), config.optim, config.train.num_steps,
                     config.seed)
  metrics, first_gradients = [], None
  for i in range(num_steps):
    metrics.append(run.step(batches[i]))
    if i == 0:
      first_gradients = run.last_gradients
  return Run(np.array([m['loss'] for m in metrics]), np.array([m['grad_norm'] for m in metrics]),
             _flat(first_gradients), _flat(run.params))


def compiled_train_step(config, mode: str, vocab_size: int = 256, devices=None):
  """(the layout, `mode`'s train step compiled ahead of time for the abstract state and batch):
  what a test reads the HLO, memory or cost analysis of, without running a step."""
  train_setup = lay_out(config, vocab_size, devices)
  batch = train_setup.abstract_batch(config.data.global_batch_size, config.data.seq_len)
  compiled = parallel.build_steps(mode, train_setup).train.lower(
      train_setup.abstract_state(), batch).compile()
  return train_setup, compiled


def collective_table(train_setup, compiled) -> dict:
  """The compiled step's collectives by (kind, mesh axes): executions and bytes (summarize)."""
  return collectives.summarize(collectives.count_collectives(compiled.as_text(),
                                                             train_setup.mesh))


def compiled_run(config, mode, num_steps):
  """`num_steps` train steps of the engine's `mode` on the mesh of `config`: (Run, the layout,
  the compiled train step, whose HLO tests may also read instead of compiling it again).

  The train step is compiled ahead of time for the abstract state and batch (as engine.train
  does), in a thread alongside the state's initialisation (initial_state): XLA compiles without
  the GIL. The first step's gradients are read back from the optimizer state
  (first_adam_gradients): a gradient program of their own took a third of each run's time."""
  corpus, batches = train_batches(config)
  train_setup = lay_out(config, corpus.tokenizer.vocab_size)
  steps = parallel.build_steps(mode, train_setup)
  abstract = train_setup.abstract_state()
  batch = train_setup.abstract_batch(config.data.global_batch_size, config.data.seq_len)
  lowered = steps.train.lower(abstract, batch)
  with futures.ThreadPoolExecutor(1) as pool:
    compiling = pool.submit(lowered.compile)
    state = initial_state(train_setup, config)
    train = compiling.result()
  sharding = train_setup.batch_sharding()
  losses, grad_norms, first_gradients = [], [], None
  for i in range(num_steps):
    state, metrics = train(state, jax.device_put(batches[i], sharding))
    losses.append(float(metrics['loss']))
    grad_norms.append(float(metrics['grad_norm']))
    if i == 0:
      first_gradients = first_adam_gradients(state['opt_state'], grad_norms[0], config.optim)
  run = Run(np.array(losses), np.array(grad_norms), first_gradients, _flat(state['params']))
  return run, train_setup, train


_INITIAL_STATES = {}


def initial_state(train_setup, config):
  """`train_setup`'s initial state, in its shardings. The first layout of a model, optimizer and
  seed creates it with its own sharded init (TrainSetup.init); later layouts of the same state
  get those values placed in their shardings instead of compiling an init of their own (its
  random initialisers were a third of a run's compile time). Equal values either way: a sharded
  init equals the one-device init on every kind of layout (tests/unit/test_sharding.py), and
  the first layout's run checks its own against the single-device reference."""
  abstract = train_setup.abstract_state()
  key = (config.model.to_json(), config.optim.to_json(), config.seed,
         config.parallelism.offload_optimizer, str(jax.tree.structure(abstract)),
         tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(abstract)))
  if key not in _INITIAL_STATES:
    state, _ = train_setup.init(config.seed)
    _INITIAL_STATES[key] = jax.device_get(state)
    return state
  return jax.device_put(_INITIAL_STATES[key], train_setup.state_shardings())


def first_adam_gradients(opt_state, grad_norm: float, optim_config) -> dict[str, np.ndarray]:
  """The gradients of a first optimizer step, by path, from Adam's first moment after it: that
  step sets mu = (1 - b1) g, g the gradients scaled down to optim.grad_clip_norm (the train
  step's clipping, engine.optimizer.clip_by_global_norm), so g = mu / (1 - b1), scaled back up.
  With Muon, its matrices' momentum holds (1 - muon_beta) g alike. A wrong gradient makes a
  wrong moment: this is the gradient the update used."""
  states = jax.tree.leaves(opt_state, is_leaf=_is_adam_state)
  adam = [s for s in states if isinstance(s, optax.ScaleByAdamState)]
  muon = [s for s in states if isinstance(s, MuonState)]
  assert len(adam) == 1 and len(muon) <= 1, (
      'the optimizer state holds no one Adam state to read gradients from')
  clip = optim_config.grad_clip_norm
  unclip = grad_norm / clip if grad_norm >= clip else 1.0
  gradients = {}
  for state, decay in [(adam[0], optim_config.b1), *[(m, optim_config.muon_beta) for m in muon]]:
    gradients.update(_flat(jax.tree.map(
        lambda mu, d=decay: np.asarray(mu, np.float32) / (1 - d) * unclip, state.mu)))
  return gradients


def _is_adam_state(node) -> bool:
  return isinstance(node, (optax.ScaleByAdamState, MuonState))


def engine_run(config, mode, num_steps) -> Run:
  """`num_steps` train steps of the engine's `mode` on the mesh of `config`."""
  return compiled_run(config, mode, num_steps)[0]


def _ungrouped(value, shape):
  value = np.asarray(value)
  if value.shape[2:] == shape[1:] and value.ndim == len(shape) + 1:
    return value.reshape(shape)
  return value


def assert_same_run(run: Run, reference: Run, atol=ATOL, param_atol=PARAM_ATOL):
  """Losses, gradient norms (relative), every first-step gradient and every final parameter.

  A circular pipeline stores stacked parameters grouped, [R, L / R, ...]: compared as [L, ...]
  (the same layers in the same order)."""
  np.testing.assert_allclose(run.losses, reference.losses, atol=atol, rtol=0)
  np.testing.assert_allclose(run.grad_norms, reference.grad_norms, rtol=atol, atol=0)
  assert run.first_gradients.keys() == reference.first_gradients.keys()
  for path, expected in reference.first_gradients.items():
    # Relative to the gradient's own scale: gradients range over orders of magnitude.
    scale = max(float(np.abs(expected).max()), 1e-30)
    actual = _ungrouped(run.first_gradients[path], expected.shape)
    np.testing.assert_allclose(actual / scale, expected / scale, atol=atol,
                               rtol=0, err_msg=f'gradient of {path}')
  for path, expected in reference.params.items():
    np.testing.assert_allclose(_ungrouped(run.params[path], expected.shape), expected,
                               atol=param_atol, rtol=0,
                               err_msg=f'parameter {path}')


def assert_resumes_exactly(config_for, tmp_path, changed: dict):
  """`config_for(steps, **changed)`: the run's config for that many steps (checkpoints every 2
  steps, written synchronously, a schedule that ends after step 6). 4 steps uninterrupted equal 2
  and then 2 more resumed, at steps 3 and 4; then the resumed run goes on to step 6 with the
  settings `changed`, restored from what it saved."""
  full = train(config_for(4), str(tmp_path / 'full')).train_losses
  train(config_for(2), str(tmp_path / 'resumed'))
  resumed = train(config_for(4), str(tmp_path / 'resumed')).train_losses
  assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)]
  after = train(config_for(6, **changed), str(tmp_path / 'resumed')).train_losses
  assert sorted(after) == [5, 6] and all(np.isfinite(list(after.values())))


def reference_python() -> str:
  """The Python of the reference environment (tests/support/reference_envs.py: CPU torch,
  transformers, peft, lm-eval, which the engine never imports); the test fails, saying how to
  build it, where it is not built."""
  try:
    return reference_envs.python()
  except RuntimeError as error:
    pytest.fail(str(error))
