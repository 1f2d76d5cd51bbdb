"""The one path from a config to a runnable setup; every command starts here.

  config -> the Hugging Face checkpoint's model settings (train.init_from=hf:DIR) -> validation
  (with the devices' process and slice counts) -> data and tokenizer -> vocabulary -> mesh,
  rules, model, optimizer (engine.state.TrainSetup) -> the mode's step builder.

`assemble(config, devices)` runs it: training, the benchmark, the bubble and compare tools, the
planner (with a TPU topology's devices), show_layout, and generate / evaluate / export (on a
finished run's config, through `assemble_finished_run`). What a command needs of the data
decides how much is read: the whole corpus (training, timing, evaluation of the held-out
split), the tokenizer that decodes (generation, evaluation of a text file), or only what fixes
the vocabulary size (export, planning, layouts).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import ml_collections

from engine import config as config_lib
from engine import data, models, parallel, sharding, validation
from engine.hf import load as hf
from engine.workdir import tokenizer as run_tokenizer
from engine.workdir import run_dir as workdir_lib
from engine.data import text_files, tokenizers
from engine.mesh import make_mesh
from engine.optimizer import make_optimizer
from engine.parallel import expert_exchange
from engine.parallel.pipeline import gpipe as pipeline
from engine.parallel.steps import Steps
from engine.sharding import rules_for
from engine.state import StepOptions, TrainSetup, make_setup
from engine.errors import ConfigError

# How much of the data a command reads (see the module docstring).
CORPUS, TOKENIZER, VOCABULARY = 'corpus', 'tokenizer', 'vocabulary'


@dataclasses.dataclass
class Run:
  """A validated config laid out on its devices: what every command works from."""
  config: ml_collections.ConfigDict
  setup: TrainSetup  # Mesh, rules, model and optimizer.
  corpus: data.Corpus | None  # With CORPUS.
  tokenizer: object | None  # With CORPUS or TOKENIZER (the one that decodes, for TOKENIZER).
  _built: dict[str, Steps] = dataclasses.field(default_factory=dict, repr=False, compare=False)

  def steps_for(self, mode: str) -> Steps:
    """`mode`'s jitted steps on this layout (built once per mode, compiled on first use): one
    layout serves both modes, so the mode is an argument, not a config key to rewrite."""
    if mode not in self._built:
      self._built[mode] = parallel.build_steps(mode, self.setup)
    return self._built[mode]

  def describe(self) -> list[str]:
    """The log's lines on what this run is: mesh, mode, rules, tokenizer, data, the model's size
    (and its parameters' bytes on each device) and, for experts split over devices, how their dropless dispatch moves tokens."""
    config, model = self.config, self.setup.model
    lines = [f'Mesh {dict(self.setup.mesh.shape)}, mode {config.parallelism.mode}, rules '
             f'{config.parallelism.rules}']
    if self.tokenizer is not None:
      lines[0] += (f'; {self.tokenizer.kind} tokenizer, vocab {self.tokenizer.vocab_size} '
                   f'(model {model.vocab_size})')
    if self.corpus is not None:
      lines[0] += f', {data.describe(self.corpus)}'
    num_params = sum(math.prod(p.shape) for p in jax.tree.leaves(self.setup.abstract_params))
    per_device = sharding.bytes_per_device(self.setup.abstract_state()['params'])
    lines.append(f'Model {model.name}: {num_params / 1e6:.3f}M parameters ({per_device / 2**20:.2f} '
                 f'MiB per device), {model.flops_per_token(config.data.seq_len) / 1e6:.3f} MFLOP '
                 'per token (training)')
    if (model.experts and not model.experts.capacity_factor and
        self.setup.rules.mesh_axes('experts', activation=True)):
      how = ('blocks moved by ' + expert_exchange.exchange_kind(self.setup)
             if expert_exchange.exchanges_dropless(self.setup, config.parallelism.mode) else
             'a slot for every position (experts / k times the rows in use)')
      lines.append(f'Experts: the dropless dispatch over mesh.expert takes {how}')
    return lines

  @property
  def steps(self) -> Steps:
    """The config's mode's steps (steps_for), which the methods below compile."""
    return self.steps_for(self.config.parallelism.mode)

  def abstract_batch(self, global_batch: int | None = None) -> jax.ShapeDtypeStruct:
    """The token batch the steps are compiled for (data.global_batch_size unless given)."""
    return self.setup.abstract_batch(global_batch or self.config.data.global_batch_size,
                                     self.config.data.seq_len)

  def compile_train_step(self, global_batch: int | None = None, compiler_options=None):
    """The train step compiled ahead of time for the abstract state and batch (with XLA
    `compiler_options`, such as engine.plan.peak_memory's dump)."""
    return compile_train_step(self.steps, self.setup, self.abstract_batch(global_batch),
                              compiler_options)

  def compile_eval_step(self, global_batch: int | None = None):
    return self.steps.eval.lower(self.setup.abstract_state()['params'],
                                 self.abstract_batch(global_batch)).compile()


def compile_train_step(steps: Steps, train_setup: TrainSetup, abstract_batch,
                       compiler_options=None):
  """A mode's train step lowered and compiled for the setup's abstract state and a batch."""
  return steps.train.lower(train_setup.abstract_state(), abstract_batch).compile(
      compiler_options)


def resolve_vocab_size(model_config, tokenizer_vocab: int) -> int:
  """The model's vocabulary: the config's, or the tokenizer's rounded up to `vocab_multiple`."""
  if model_config.vocab_size == -1:
    return math.ceil(tokenizer_vocab / model_config.vocab_multiple) * model_config.vocab_multiple
  if model_config.vocab_size < tokenizer_vocab:
    raise ConfigError(
        f'model.vocab_size={model_config.vocab_size} is smaller than the tokenizer\'s '
        f'{tokenizer_vocab} tokens; raise it or set it to -1.')
  return model_config.vocab_size


def documents_eos_id(config: ml_collections.ConfigDict, tokenizer) -> int | None:
  """The end-of-text id that ends each packed document (data.document_masking), or None."""
  if not config.data.document_masking:
    return None
  if tokenizer is None or tokenizer.eos_id is None:
    raise ConfigError(
        f'data.document_masking=true needs the tokenizer\'s end-of-text id to find where '
        f'documents end, but data.tokenizer={config.data.tokenizer!r} has none; use a tokenizer '
        'with one (hf or sentencepiece), or set --config.data.document_masking=false.')
  return tokenizer.eos_id


def _tokenizer(data_config, seed: int, reads: str):
  """The run's tokenizer without the corpus: shards name theirs in meta.json (the file itself
  for TOKENIZER, which must decode: data.tokenizer_path, else the recorded one, checked against
  the record); a character vocabulary comes from the text."""
  if data_config.source == 'shards':
    shards = data.load_shards(data_config)
    if reads == VOCABULARY:
      return shards.tokenizer
    return tokenizers.load(shards.tokenizer.kind, shards.tokenizer.path)
  text = data.load_text(data_config, seed) if data_config.tokenizer == 'char' else ''
  return tokenizers.load(data_config.tokenizer, data_config.tokenizer_path, text)


def flat_gather(parallelism: ml_collections.ConfigDict, mesh) -> bool:
  """parallelism.fsdp_gather resolved for the mesh's devices: 'auto' gathers a layer's weights
  together on CPU devices only, where XLA combines no all-gathers or reduce-scatters itself; on
  TPU and GPU its combiners do, and the cut of a flat buffer into weights would only cost copies
  and memory (docs/benchmarks.md, "Steps on simulated CPU devices")."""
  choice = parallelism.fsdp_gather  # An older run's config.json gains it in run_dir.upgrade.
  if choice == 'auto':
    return mesh.devices.flat[0].platform == 'cpu'
  return choice == 'per_layer'


def lay_out(config: ml_collections.ConfigDict, tokenizer_vocab: int, devices=None,
            eos_id: int | None = None) -> TrainSetup:
  """Mesh, rules, model and optimizer of a validated config, for a tokenizer of
  `tokenizer_vocab` ids (0: model.vocab_size decides). The mesh spans `devices` (default: this
  run's; engine.plan passes a TPU topology's). `eos_id`: the tokenizer's end-of-text id, which
  data.document_masking needs (documents_eos_id)."""
  mesh = make_mesh(config.mesh, devices)
  rules = rules_for(config.parallelism.rules, dict(mesh.shape))
  vocab_size = resolve_vocab_size(config.model, tokenizer_vocab)
  model = dataclasses.replace(models.build(config.model, vocab_size),
                              layer_groups=config.train.pipeline_repeats)
  options = StepOptions(compute_dtype=config.model.dtype, remat=config.model.remat,
                        loss_chunks=config.model.loss_chunks,
                        microbatches=config.train.microbatches,
                        pipeline_schedule=pipeline.schedule_of(config.train),
                        pipeline_head=config.train.get('pipeline_head', 'split'),
                        grad_reduce_dtype=config.parallelism.grad_reduce_dtype,
                        gather_dtype=config.parallelism.gather_dtype,
                        optimizer_sharding=config.parallelism.optimizer_sharding,
                        offload_optimizer=config.parallelism.offload_optimizer,
                        flat_gather=flat_gather(config.parallelism, mesh),
                        skip_nonfinite=config.train.skip_nonfinite_steps > 0,
                        eos_id=eos_id if config.data.document_masking else None)
  optimizer = make_optimizer(config.optim, config.train.num_steps,
                             model.trainable_mask if model.trainable else None)
  train_setup = make_setup(model, optimizer, mesh, rules, options)
  validation.check_layout(train_setup)
  return train_setup


def check(config: ml_collections.ConfigDict, devices, *, training: bool = True,
          reads_text: bool = True) -> ml_collections.ConfigDict:
  """What assemble checks before it reads data or builds anything: the config on `devices`
  (engine.sweep checks every variant so before the first one trains). Returns the config the
  run uses, a copy (with train.init_from=hf:DIR, DIR's model settings); `config` is left as it
  was."""
  config = hf.with_model_config(config)
  num_processes = len({d.process_index for d in devices})
  validation.validate(config, len(devices), num_processes, validation.count_slices(devices),
                      training=training, reads_text=reads_text,
                      platform=devices[0].platform if devices else '')
  return config


def assemble(config: ml_collections.ConfigDict, devices=None, *, reads: str = CORPUS,
             corpus: data.Corpus | None = None, training: bool = True,
             tokenizer=None) -> Run:
  """The config validated and laid out on `devices` (default: all of this run's), before
  anything compiles. `corpus` reuses data already read (commands that assemble several variants of
  one config); `tokenizer` is the one that decodes, already loaded (a finished run's kept copy), for
  the reads other than CORPUS; `training=False` skips the checks that only a train step needs (the
  batch's split, the pipeline schedule), for a finished run's generation and export."""
  devices = list(devices if devices is not None else jax.devices())
  # The text is read for the corpus, or for a character vocabulary not given already loaded.
  reads_text = reads == CORPUS or (tokenizer is None and config.data.tokenizer == 'char')
  config = check(config, devices, training=training, reads_text=reads_text)
  if corpus is None and reads == CORPUS:
    corpus = data.load_corpus(config.data, config.seed)
  if corpus is not None and reads != TOKENIZER:
    tokenizer = corpus.tokenizer
  if tokenizer is None and (reads == TOKENIZER or config.model.vocab_size == -1 or
                            config.data.document_masking):
    tokenizer = _tokenizer(config.data, config.seed, reads)
  train_setup = lay_out(config, tokenizer.vocab_size if tokenizer else 0, devices,
                        documents_eos_id(config, tokenizer))
  if training and hf.path_of(config.train.init_from):  # Its files, before anything is written.
    hf.check(hf.path_of(config.train.init_from),
             train_setup.model.base_params(train_setup.abstract_params))
  return Run(config, train_setup, corpus, tokenizer)


def _check_run_text(workdir: str, data_config, reads: str, kept) -> None:
  """A finished run's training text, where this command still needs it, checked in the run's
  terms (the commands that read a finished run have no --config.data.path to fix it with): the
  held-out split, or a character vocabulary the workdir keeps no copy of (an older run)."""
  if data_config.source != 'file':
    return
  if reads == CORPUS:
    why = 'the held-out split is read from it'
  elif kept is None and data_config.tokenizer == 'char':
    why = ("the workdir keeps no copy of the run's character vocabulary (the run predates the "
           'copy), so it is read from that text')
  else:
    return
  text_files.check_file(data_config.path,
                        f"--workdir={workdir}: the run's text, data.path={data_config.path!r},",
                        f'{why}: put the file back at that path.')


def assemble_finished_run(workdir: str, mesh: str, where: str = '--mesh',
                          reads: str = TOKENIZER) -> Run:
  """A finished run's config (WORKDIR/config.json) laid out on `mesh` (a mesh string, on the
  first devices of this machine that it needs): what generation, evaluation and export restore
  its checkpoint into. The tokenizer is the copy the workdir keeps (engine/workdir/tokenizer.py),
  where it has one: a corpus read for evaluation is checked against it, and nothing else is
  read for the others."""
  recorded = workdir_lib.read_run_config(workdir)
  kept = run_tokenizer.load_kept(workdir, workdir_lib.read_saved(workdir))
  _check_run_text(workdir, recorded.data, reads, kept)
  values = {
      'train.init_from': '',  # The parameters are the workdir's own checkpoint's.
      'mesh.dcn_data': 1, 'mesh.dcn_fsdp': 1, **config_lib.mesh_values(mesh, where)}
  if kept is not None and kept.kind != 'char':
    values['data.tokenizer_path'] = kept.path  # Shards check it against their meta.json.
  config = config_lib.with_values(recorded, values)
  sizes = [config.mesh[axis] for axis in config_lib.MESH_AXES]
  count = math.prod(size for size in sizes if size > 0)
  # A mesh of fixed sizes takes the first devices it needs; with a -1 (or more than there are,
  # which validation then refuses in one line) it takes them all.
  devices = jax.devices() if -1 in sizes or count > jax.device_count() else (
      jax.devices()[:count])
  return assemble(config, devices, reads=reads, training=False,
                  tokenizer=kept if reads != CORPUS else None)
