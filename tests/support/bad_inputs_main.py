"""Bad input to `python -m engine.main`: each row of BAD_INPUTS is something a user could type,
with the exit status and the one line, `error: ...`, that it gets.
tests/commands/test_bad_inputs.py runs them; docs/bad_inputs.md lists them (the other commands'
rows are tests/support/bad_inputs_commands.py).

In argv and messages, `$T` stands for the test's scratch directory, which holds the files of
SCRATCH.
"""

import json

import numpy as np
from safetensors.numpy import save as safetensors_bytes

TINY = '--config=experiments/tiny.py'
RUN = '--workdir=$T/run'
FILE = '--config.data.source=file'
SHARDS = '--config.data.source=shards'
LLAMA = '--config.model.name=llama'
MOE = [LLAMA, '--config.model.num_experts=4']  # A Llama with a mixture of experts.

# A tiny Llama's config.json (two layers).
HF_LLAMA = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 16,
            'intermediate_size': 32, 'num_hidden_layers': 2, 'num_attention_heads': 2,
            'num_key_value_heads': 2, 'vocab_size': 256, 'rms_norm_eps': 1e-5,
            'max_position_embeddings': 64, 'hidden_act': 'silu',
            'rope_parameters': {'rope_type': 'default', 'rope_theta': 1e4}}

# Tiny mixture-of-experts config.json files (4 experts, 2 per token).
HF_MIXTRAL = dict(HF_LLAMA, architectures=['MixtralForCausalLM'], model_type='mixtral',
                  num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
HF_QWEN3_MOE = dict(HF_LLAMA, architectures=['Qwen3MoeForCausalLM'], model_type='qwen3_moe',
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _one_layer_of_two() -> bytes:
  """HF_LLAMA's weights with layer 1 missing."""
  D, F, V = 16, 32, 256
  tensors = {'model.embed_tokens.weight': (V, D), 'model.norm.weight': (D,),
             'lm_head.weight': (V, D)}
  p = 'model.layers.0.'
  tensors.update({p + 'input_layernorm.weight': (D,), p + 'post_attention_layernorm.weight': (D,),
                  p + 'mlp.gate_proj.weight': (F, D), p + 'mlp.up_proj.weight': (F, D),
                  p + 'mlp.down_proj.weight': (D, F),
                  **{p + f'self_attn.{x}_proj.weight': (D, D) for x in 'qkvo'}})
  return safetensors_bytes({k: np.zeros(v, np.float32) for k, v in tensors.items()})


# What each test's scratch directory $T holds before the run (text, or bytes).
SCRATCH = {
    'latin1.txt': b'caf\xe9 au lait\n',  # Latin-1, not UTF-8.
    'empty.txt': '',
    'short.txt': 'hello world\n',
    'notes.txt': 'keep me',
    'typo_experiment.py': ('from engine.config import default_config\n\n\n'
                           'def get_config(arg=None):\n  config = default_config()\n'
                           '  config.model.num_layer = 4\n  return config\n'),
    'broken_experiment.py': 'def get_config(arg=None):\n  return defaults()\n',
    'unfinished_run/checkpoints/100.orbax-checkpoint-tmp-1/': None,  # A save cut short.
    # A complete checkpoint whose files are gone since (its checksums name one).
    'damaged_run/checkpoints/2/checksums.json': json.dumps({'state/manifest.ocdbt': [120, 7]}),
    # Hugging Face checkpoints the engine does not compute exactly, or that are incomplete.
    'hf_yarn/config.json': json.dumps(dict(
        HF_LLAMA, rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e4})),
    'hf_window/config.json': json.dumps(dict(
        HF_LLAMA, architectures=['MistralForCausalLM'], model_type='mistral', sliding_window=8)),
    'hf_jitter/config.json': json.dumps(dict(HF_MIXTRAL, router_jitter_noise=0.01)),
    'hf_unnormalised/config.json': json.dumps(dict(HF_QWEN3_MOE, norm_topk_prob=False)),
    'hf_dense_layers/config.json': json.dumps(dict(HF_QWEN3_MOE, decoder_sparse_step=2)),
    # Shard sets whose meta.json is damaged.
    'garbled_set/meta.json': '{"format": \n',
    'keyless_set/meta.json': '{"format": "engine-token-shards/1"}',
    'hf_missing/config.json': json.dumps(HF_LLAMA),
    'hf_missing/model.safetensors': _one_layer_of_two(),
}

# (argv without the program, exit status, the line on stderr after `error: `).
BAD_INPUTS = [
    # The command line.
    ([TINY], 2, '--workdir is required: the directory for checkpoints and metrics (rerun with the '
     'same one to resume), e.g. --workdir=/tmp/tiny.'),
    ([RUN], 2, '--config is required: the experiment file, e.g. --config=experiments/tiny.py.'),
    (['--config=', RUN], 2,
     '--config is empty; pass an experiment file, e.g. --config=experiments/tiny.py.'),
    ([TINY, '--workdir='], 2, '--workdir is empty; pass the directory for checkpoints and '
     'metrics, e.g. --workdir=/tmp/run.'),
    ([TINY, '--workdir'], 2, '--workdir has no value; write --workdir=VALUE.'),
    ([TINY, RUN, 'extra'], 2, "unexpected arguments ['extra']; everything is given as a flag, "
     '--name=value (e.g. --config.train.num_steps=50), and a value holding spaces is quoted.'),
    ([TINY, '--workdri=$T/run'], 2, '--workdri is not a flag (did you mean --workdir?); python -m '
     'engine.main --helpfull lists them, and config keys are set with --config.KEY=VALUE.'),
    ([TINY, RUN, '--debug=maybe'], 2,
     '--debug=maybe is not true or false; give one, e.g. --debug=false.'),
    ([TINY, RUN, '--num_processes=two'], 2, '--num_processes=two is not an integer; give one.'),
    ([TINY, RUN, '--num_processes=2'], 2, '--num_processes=2 asks for several processes, but '
     'there is no --coordinator_address (nor JAX_COORDINATOR_ADDRESS, nor a cluster that provides '
     'one); pass --coordinator_address=HOST:PORT of process 0, or start the processes with python '
     '-m launch.local.'),
    ([TINY, RUN, '--num_processes=0'], 2, '--num_processes=0 must be at least 1.'),
    ([TINY, RUN, '--coordinator_address=localhost:1234', '--num_processes=2', '--process_id=2'], 2,
     '--process_id=2 must be below --num_processes=2: processes are numbered 0 to 1.'),
    ([TINY, RUN, '--coordinator_address=localhost:1234'], 2, '--coordinator_address needs '
     '--num_processes and --process_id too (or JAX_NUM_PROCESSES and JAX_PROCESS_ID).'),
    ([TINY, RUN, '--coordinator_address=192.0.2.1:1234', '--num_processes=2', '--process_id=1'],
     2, '--coordinator_address=192.0.2.1:1234 reaches beyond this machine, and ENGINE_RUN_TOKEN is '
     'not set, so any process that knows the protocol could join the run; export the same secret '
     'in every process (export ENGINE_RUN_TOKEN=$(python -c "import secrets; print(secrets.'
     'token_hex(32))"), shared with every host), or start the processes with python -m '
     'launch.local.'),
    ([TINY, RUN, '--heartbeat_timeout_s=0'], 2,
     '--heartbeat_timeout_s=0 must be at least 1 (seconds).'),
    # The experiment file and its arguments.
    (['--config=experiments/no_such_experiment.py', RUN], 2,
     '--config=experiments/no_such_experiment.py: experiments/no_such_experiment.py does not '
     'exist; pass an experiment file, e.g. --config=experiments/tiny.py (the experiments are in '
     'experiments/).'),
    (['--config=experiments', RUN], 2, '--config=experiments: experiments is a directory; pass an '
     'experiment file, e.g. --config=experiments/tiny.py.'),
    (['--config=$T/notes.txt', RUN], 2, '--config=$T/notes.txt failed to load (SyntaxError: '
     'invalid syntax (notes.txt, line 1)); fix the file, or see the traceback with --debug.'),
    (['--config=engine/mesh.py', RUN], 2, '--config=engine/mesh.py: the file defines no '
     'get_config(); an experiment file defines get_config(arg=None) returning the config, as '
     'experiments/tiny.py does.'),
    (['--config=$T/broken_experiment.py', RUN], 2, "--config=$T/broken_experiment.py failed to "
     "load (NameError: name 'defaults' is not defined); fix the file, or see the traceback with "
     '--debug.'),
    (['--config=$T/typo_experiment.py', RUN], 2, "Unknown config keys ['model.num_layer'] (did "
     'you mean model.num_layers?); see engine/config.py default_config() for the schema (a typo '
     'in an override?).'),
    (['--config=experiments/tiny.py:foo=1', RUN], 2, "--config=experiments/tiny.py:foo=1: Unknown "
     "experiment argument 'foo'; the experiment takes mesh, mode, steps (e.g. "
     ':steps=100,mesh=2x2x2).'),
    (['--config=experiments/tiny.py:steps=abc', RUN], 2,
     '--config=experiments/tiny.py:steps=abc: experiment argument steps=abc is not an integer; '
     'give one, e.g. steps=600.'),
    (['--config=experiments/tiny.py:mesh=2x2', RUN], 2, '--config=experiments/tiny.py:mesh=2x2: '
     'mesh=2x2: a mesh is DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]], 3 to 6 integers joined by '
     'x (axes not given are 1); e.g. 2x2x2, 2x1x1x2x2 for context 2 and stage 2, or 1x1x1x1x1x4 '
     'for expert 4 (-1: the devices the other axes leave, e.g. -1x1x2).'),
    # Overrides: keys and types.
    ([TINY, RUN, '--config.model.num_layerz=3'], 2, '--config.model.num_layerz=3: the config has '
     'no key model.num_layerz (did you mean model.num_layers?); the keys and their defaults are in '
     'engine/config.py, default_config().'),
    ([TINY, RUN, '--config.optimizer.b2=0.95'], 2, '--config.optimizer.b2=0.95: the config has no '
     'key optimizer.b2 (did you mean optim.b2?); the keys and their defaults are in '
     'engine/config.py, default_config().'),
    # Abbreviations, and keys of another section.
    ([TINY, RUN, '--config.optim.lr=3e-4'], 2, '--config.optim.lr=3e-4: the config has no key '
     'optim.lr (did you mean optim.learning_rate?); the keys and their defaults are in '
     'engine/config.py, default_config().'),
    ([TINY, RUN, '--config.wd=0'], 2, '--config.wd=0: the config has no key wd (did you mean '
     'optim.weight_decay?); the keys and their defaults are in engine/config.py, '
     'default_config().'),
    ([TINY, RUN, '--config.data.batch_size=8'], 2, '--config.data.batch_size=8: the config has no '
     'key data.batch_size (did you mean data.global_batch_size?); the keys and their defaults '
     'are in engine/config.py, default_config().'),
    ([TINY, RUN, '--config.train.learning_rate=3e-4'], 2, '--config.train.learning_rate=3e-4: the '
     'config has no key train.learning_rate (did you mean optim.learning_rate?); the keys and '
     'their defaults are in engine/config.py, default_config().'),
    ([TINY, RUN, '--config.model.seq_len=128'], 2, '--config.model.seq_len=128: the config has no '
     'key model.seq_len (did you mean data.seq_len?); the keys and their defaults are in '
     'engine/config.py, default_config().'),
    ([TINY, RUN, '--config.optim.steps=10'], 2, '--config.optim.steps=10: the config has no key '
     'optim.steps (did you mean optim.warmup_steps or optim.decay_steps?); the keys and their '
     'defaults are in engine/config.py, default_config().'),
    ([TINY, RUN, '--config.model=gpt'], 2, '--config.model=gpt: model is a section of the config, '
     'not a value; set its keys one by one, e.g. --config.model.attention=einsum.'),
    (['--config.optim.b2=0.95', TINY, RUN], 2, '--config.optim.b2=0.95 comes before --config, '
     'which it overrides; give --config=EXPERIMENT first, then the overrides.'),
    ([TINY, RUN, '--config.train.num_steps'], 2,
     '--config.train.num_steps has no value; write --config.train.num_steps=VALUE.'),
    ([TINY, RUN, '--config.train.num_steps=abc'], 2, '--config.train.num_steps=abc is not an '
     'integer; give one, e.g. --config.train.num_steps=300.'),
    ([TINY, RUN, '--config.model.num_layers=2.5'], 2, '--config.model.num_layers=2.5 is not an '
     'integer; give one, e.g. --config.model.num_layers=2.'),
    ([TINY, RUN, '--config.optim.learning_rate=fast'], 2, '--config.optim.learning_rate=fast is '
     'not a number; give one, e.g. --config.optim.learning_rate=0.001.'),
    ([TINY, RUN, '--config.model.tie_embeddings=maybe'], 2, '--config.model.tie_embeddings=maybe '
     'is not true or false; give one, e.g. --config.model.tie_embeddings=true.'),
    (['--config=experiments/tiny.py:mesh=2x2x2', RUN, '--config.mesh.tensor=x'], 2,
     '--config.mesh.tensor=x is not an integer; give one, e.g. --config.mesh.tensor=1.'),
    # Values: names that are not among the choices.
    ([TINY, RUN, '--config.model.name=gpt3'], 2,
     "model.name='gpt3' is unknown; choose one of ['gpt', 'llama']."),
    ([TINY, RUN, '--config.parallelism.mode=pipeline'], 2,
     "parallelism.mode='pipeline' is unknown; choose one of ['auto', 'manual']."),
    ([TINY, RUN, '--config.parallelism.fsdp_gather=flat'], 2,
     "parallelism.fsdp_gather='flat' is unknown; choose one of ('auto', 'per_layer', "
     "'per_weight')."),
    ([TINY, RUN, '--config.model.matmul_precision=int4'], 2,
     "model.matmul_precision='int4' is unknown; choose one of ('default', 'int8', 'fp8')."),
    ([TINY, RUN, '--config.model.matmul_precision=int8'], 2,
     'model.matmul_block=128 does not divide model.embed_dim (64): each device quantizes its '
     'part of a contraction in whole blocks; give --config.model.matmul_block=64 (it divides '
     'every one), or change the sizes.'),
    ([TINY, RUN, '--config.model.matmul_precision=fp8', '--config.model.matmul_block=0'], 2,
     'model.matmul_block=0 must be positive: the contraction elements that share a scale (128 '
     'is the usual).'),
    ([TINY, RUN, '--config.parallelism.gather_dtype=int4'], 2,
     "parallelism.gather_dtype='int4' is unknown; choose one of ('default', 'int8', 'fp8')."),
    ([TINY, RUN, '--config.parallelism.gather_dtype=int8', '--config.mesh.fsdp=8',
      '--config.mesh.data=1'], 2, "parallelism.gather_dtype='int8' needs parallelism.mode=manual: "
     "in auto mode the compiler picks what its gathers send (engine.compare's collectives table "
     "shows it); set it to 'default', or use manual mode."),
    ([TINY, RUN, '--config.parallelism.gather_dtype=fp8', '--config.parallelism.mode=manual'], 2,
     "parallelism.gather_dtype='fp8' quantizes the FSDP weight gathers, and mesh.fsdp=1 has "
     "none; set it to 'default', or give mesh.fsdp a size > 1."),
    ([TINY, RUN, '--config.parallelism.rules=zero3'], 2, "parallelism.rules='zero3' is unknown; "
     "choose 'auto' or one of ['data_parallel', 'fsdp', 'fsdp_tensor', 'tensor']."),
    ([TINY, RUN, '--config.data.source=hf'], 2,
     "data.source='hf' is unknown; choose one of ('embedded', 'file', 'synthetic', "
     "'shards')."),
    ([TINY, RUN, '--config.data.tokenizer=bpe'], 2,
     "data.tokenizer='bpe' is unknown; choose one of ('byte', 'char', 'hf', 'sentencepiece')."),
    ([TINY, RUN, '--config.data.tokenizer=hf'], 2, "data.tokenizer='hf' reads "
     "data.tokenizer_path, but '' is not a file; pass --config.data.tokenizer_path=PATH "
     '(python -m engine.data.train_tokenizer makes a tokenizer.json from any text).'),
    ([TINY, RUN, '--config.data.source=shards'], 2, "data.source='shards' reads data.shards, "
     'which is empty; pass --config.data.shards=DIR (an engine.data.prepare output; DIR:WEIGHT,... '
     'to mix).'),
    ([TINY, RUN, '--config.model.dtype=float16'], 2,
     "model.dtype='float16' is unknown; choose one of ('float32', 'bfloat16')."),
    ([TINY, RUN, '--config.model.attention=flash'], 2,
     "model.attention='flash' is unknown; choose one of ('einsum', 'dot_product_attention', "
     "'splash')."),
    # What the splash kernel cannot take.
    (['--config=experiments/tiny.py:mesh=4x1x1x2', RUN, '--config.model.attention=splash'], 2,
     "model.attention='splash' with mesh.context=2 in auto mode: the kernel needs whole "
     "sequences or ring attention's blocks; set parallelism.mode='manual' (ring attention runs "
     "it per block), model.attention='einsum' or mesh.context=1."),
    # Manual mode's ring runs it on chunks of seq_len / (2 * context) positions.
    (['--config=experiments/tiny.py:mode=manual,mesh=4x1x1x2', RUN,
      '--config.model.attention=splash', '--config.data.seq_len=256',
      '--config.model.max_len=256'], 2,
     "model.attention='splash' with mesh.context=2 needs data.seq_len divisible by "
     "2*mesh.context*128=512 (ring attention runs the kernel on chunks of data.seq_len / "
     "(2*mesh.context) positions, tiles of 128), not 256; pick such a length or "
     "model.attention='einsum'."),
    (['--config=experiments/tiny.py:mode=manual,mesh=4x1x1x2', RUN,
      '--config.model.attention=dot_product_attention'], 2,
     "model.attention='dot_product_attention' with mesh.context=2 in manual mode: ring attention "
     "computes its own blocks; set model.attention='einsum' or 'splash' (auto mode may keep "
     "it)."),
    ([TINY, RUN, '--config.model.attention=splash'], 2, "model.attention='splash' needs "
     "data.seq_len divisible by 128 (the kernel's tile), not 64; pick such a length or "
     "model.attention='einsum'."),
    ([TINY, RUN, '--config.model.attention=splash', '--config.data.seq_len=128',
      '--config.model.max_len=128', '--config.model.attention_scale_on=logits'], 2,
     "model.attention='splash' with model.attention_scale_on='logits': the kernel cannot scale "
     "the logits; set model.attention_scale_on='queries'."),
    # Values that would train wrong, or not at all.
    ([TINY, RUN, '--config.optim.b2=1.5'], 2, 'optim.b2=1.5 must lie in [0, 1): it is how much of '
     'its running average Adam keeps each step (usual: b1=0.9, b2 from 0.95 to 0.999).'),
    # --print_config lists the config (stdout), then refuses the value as the run would.
    ([TINY, '--config.optim.b2=1.5', '--print_config'], 2, 'optim.b2=1.5 must lie in [0, 1): it '
     'is how much of its running average Adam keeps each step (usual: b1=0.9, b2 from 0.95 to '
     '0.999).'),
    ([TINY, RUN, '--config.optim.learning_rate=nan'], 2,
     'optim.learning_rate=nan is not a finite number; give one.'),
    ([TINY, RUN, '--config.optim.b1=1e400'], 2, 'optim.b1=inf is not a finite number; give one.'),
    ([TINY, RUN, '--config.optim.grad_clip_norm=0'], 2, 'optim.grad_clip_norm=0.0 must be '
     'positive: gradients are scaled down to this global norm (inf turns clipping off).'),
    ([TINY, RUN, '--config.optim.weight_decay=-0.1'], 2, 'optim.weight_decay=-0.1 must be >= 0.'),
    ([TINY, RUN, '--config.optim.warmup_steps=-5'], 2, 'optim.warmup_steps=-5 must be >= 0.'),
    ([TINY, RUN, '--config.optim.decay_steps=10'], 2, 'optim.decay_steps=10 must exceed '
     'optim.warmup_steps=20 (it counts the warmup), or be -1 to end at train.num_steps.'),
    ([TINY, RUN, '--config.model.remat=offload_dots_with_no_batch_dims'], 2,
     "model.remat='offload_dots_with_no_batch_dims' keeps the saved activations in host memory, "
     'which XLA:CPU does not separate from device memory (the step would keep them all the '
     'same); use it on TPU or GPU (engine.plan compiles it for a TPU topology), or '
     "model.remat='dots_with_no_batch_dims_saveable' here."),
    ([TINY, RUN, '--config.parallelism.offload_optimizer=True'], 2,
     'parallelism.offload_optimizer=True keeps the optimizer state in host memory, which '
     'XLA:CPU does not separate from device memory; use it on TPU or GPU (engine.plan compiles '
     'it for a TPU topology), or set it to False here.'),
    ([TINY, RUN, '--config.model.loss_chunks=3'], 2,
     'model.loss_chunks=3 must divide the positions of a sequence on each device '
     '(data.seq_len / mesh.context = 64 / 1 = 64); pick a divisor of it, or 1 for the whole '
     'sequence at once.'),
    ([TINY, RUN, '--config.parallelism.optimizer_sharding=zero3'], 2,
     "parallelism.optimizer_sharding='zero3' is unknown; choose one of ('params', 'zero1')."),
    (['--config=experiments/tiny.py:mode=manual', RUN, *MOE,
      '--config.model.moe_balance=aux_free', '--config.parallelism.optimizer_sharding=zero1'], 2,
     "parallelism.optimizer_sharding='zero1' in manual mode with model.moe_balance='aux_free' is "
     'not supported yet: the router bias moves as a whole, not by ZeRO-1 blocks; use '
     "parallelism.mode=auto, or model.moe_balance='aux_loss'."),
    ([TINY, RUN, '--config.optim.name=sgd'], 2,
     "optim.name='sgd' is unknown; choose one of ('adamw', 'muon')."),
    ([TINY, RUN, '--config.optim.name=muon', '--config.optim.muon_beta=1'], 2,
     'optim.muon_beta=1.0 must lie in [0, 1): it is how much of its momentum Muon keeps each '
     'step (usual: 0.95).'),
    (['--config=experiments/tiny.py:mode=manual', RUN, '--config.optim.name=muon',
      '--config.parallelism.optimizer_sharding=zero1'], 2,
     "parallelism.optimizer_sharding='zero1' in manual mode with optim.name='muon' is not "
     'supported yet: Muon makes each matrix whole over the axes that split its parameter, not '
     "its ZeRO-1 blocks; use parallelism.mode=auto, or optimizer_sharding='params'."),
    ([TINY, RUN, '--config.optim.mu_dtype=float16'], 2,
     "optim.mu_dtype='float16' is unknown; choose one of ('float32', 'bfloat16')."),
    ([TINY, RUN, '--config.optim.schedule=linear'], 2,
     "optim.schedule='linear' is unknown; choose one of ('cosine', 'constant', 'wsd')."),
    ([TINY, RUN, '--config.optim.schedule=wsd', '--config.optim.decay_fraction=0'], 2,
     'optim.decay_fraction=0.0 must lie in (0, 1]: it is the share of the steps that wsd spends '
     'decaying (usual: 0.1 to 0.2).'),
    ([TINY, RUN, '--config.optim.schedule=constant', '--config.optim.decay_steps=200'], 2,
     'optim.decay_steps=200 has no effect with optim.schedule=constant (it never decays); leave '
     'decay_steps at -1, or choose optim.schedule=cosine or wsd.'),
    ([TINY, RUN, '--config.train.num_steps=0'], 2, 'train.num_steps=0 must be positive.'),
    ([TINY, RUN, '--config.train.hang_timeout_s=-1'], 2, 'train.hang_timeout_s=-1.0 must be >= 0 '
     '(seconds a step may take; 0 turns the check off).'),
    ([TINY, RUN, '--config.train.straggler_factor=0.5'], 2, 'train.straggler_factor=0.5 would '
     'name a process no slower than the others; pass a factor above 1 (e.g. 2), or 0 for no '
     'straggler warnings.'),
    ([TINY, RUN, '--config.train.local_checkpoint_dir=gs://bucket/local'], 2,
     "train.local_checkpoint_dir='gs://bucket/local' is not on this host: the local tier is fast "
     'storage of each host (a local disk or RAM disk); pass such a path, or leave the bucket to '
     '--workdir.'),
    ([TINY, RUN, '--config.model.name=llama', '--config.model.lora_rank=4',
      '--config.model.lora_targets=q_proj,qkv'], 2, "model.lora_targets='q_proj,qkv': 'qkv' "
     'names no projection; name any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, '
     'down_proj, comma-separated.'),
    ([TINY, RUN, '--config.model.name=llama', '--config.model.lora_rank=4',
      '--config.model.num_experts=4'], 2, "model.lora_targets names 'gate_proj', but "
     'model.num_experts=4 puts experts in place of the MLP projections; adapt the attention '
     'projections only (q_proj,k_proj,v_proj,o_proj).'),
    ([TINY, RUN, '--config.model.name=llama', '--config.model.lora_rank=4',
      '--config.optim.name=muon'], 2, "model.lora_rank=4 trains its adapters with AdamW; "
     "optim.name='muon' is not supported with LoRA: pass --config.optim.name=adamw."),
    ([TINY, RUN, '--config.train.loggers=tensorboard'], 2, "train.loggers='tensorboard' leaves "
     "out jsonl: metrics.jsonl is the run's record (summary.json and sweeps read it); keep jsonl "
     'in the list, e.g. tensorboard,jsonl.'),
    ([TINY, RUN, '--config.train.loggers=jsonl,mlflow'], 2, "train.loggers='jsonl,mlflow': "
     "'mlflow' is not a logger; name any of jsonl, tensorboard, wandb, comma-separated (e.g. "
     'tensorboard,jsonl,wandb).'),
    ([TINY, RUN, '--config.train.loggers=jsonl,wandb', '--config.train.wandb_mode=cloud'], 2,
     "train.wandb_mode='cloud' is not a mode; pass online, offline (no network: wandb sync "
     "uploads it later), or '' (WANDB_MODE, else online)."),
    ([TINY, RUN, '--config.train.local_checkpoint_every=0'], 2,
     'train.local_checkpoint_every=0 must be positive.'),
    ([TINY, RUN, '--config.train.compile_cache_dir=$T/notes.txt'], 2,
     "train.compile_cache_dir='$T/notes.txt' is a file; pass a directory for the compiled "
     "programs, '' for WORKDIR/compile_cache, or 'none' for no cache."),
    ([TINY, RUN, '--config.train.profile_steps=5'], 2, "train.profile_steps='5' must be A:B, "
     'the first and last step to trace, e.g. 10:12.'),
    ([TINY, RUN, '--config.train.profile_steps=12:10'], 2, "train.profile_steps='12:10' must "
     'have 1 <= A <= B <= train.num_steps=600; e.g. 10:12 traces steps 10, 11 and 12.'),
    ([TINY, RUN, '--config.train.num_steps=50', '--config.train.profile_steps=40:60'], 2,
     "train.profile_steps='40:60' must have 1 <= A <= B <= train.num_steps=50; e.g. 10:12 traces "
     'steps 10, 11 and 12.'),
    ([TINY, RUN, '--config.train.sample_every=-10'], 2, 'train.sample_every=-10 must be >= 0 '
     '(0: no samples; N: a sample every N steps).'),
    ([TINY, RUN, '--config.train.sample_every=50', '--config.train.sample_tokens=-1'], 2,
     "train.sample_tokens=-1 must be >= 0 (0: 64, or what a GPT model's learned positions "
     'leave).'),
    ([TINY, RUN, '--config.train.sample_every=50', '--config.train.sample_temperature=-1'], 2,
     'train.sample_temperature=-1.0 must be a finite number >= 0 (0: greedy).'),
    ([TINY, RUN, '--config.train.sample_every=50', '--config.train.sample_tokens=64'], 2,
     'train.sample_tokens=64 with the 1 tokens of train.sample_prompt exceeds the GPT model\'s '
     'learned positions (model.max_len): 64; give train.sample_tokens <= 63 (0: what they '
     'leave).'),
    ([TINY, RUN, '--config.model.max_len=8', '--config.data.seq_len=8',
      '--config.train.sample_every=50', '--config.train.sample_prompt=abcdefgh'], 2,
     "train.sample_prompt='abcdefgh' takes 8 tokens, all of the GPT model's learned positions "
     '(model.max_len): 8, leaving none to sample; shorten it.'),
    ([TINY, RUN, '--config.data.global_batch_size=-16'], 2,
     'data.global_batch_size=-16 must be positive.'),
    ([TINY, RUN, '--config.data.val_fraction=1.5'], 2, 'data.val_fraction=1.5 must lie in (0, 1).'),
    ([TINY, RUN, '--config.seed=-1'], 2, 'seed=-1 must lie in [0, 4294967294]: the data order is '
     'shuffled with 32-bit seeds (evaluation uses seed + 1); give e.g. --config.seed=0.'),
    # Model sizes that do not fit together.
    ([TINY, RUN, '--config.model.embed_dim=66'], 2, 'model.embed_dim=66 is not divisible by '
     'model.num_heads=4; change one of them so that model.num_heads divides model.embed_dim.'),
    ([TINY, RUN, '--config.model.num_kv_heads=3'], 2, 'model.num_kv_heads=3 must divide '
     'model.num_heads=4 (each key/value head serves a group of query heads), or be -1 for one per '
     'query head.'),
    ([TINY, RUN, '--config.model.name=llama', '--config.model.num_heads=8',
      '--config.model.embed_dim=40'], 2, 'model.embed_dim / model.num_heads = 5 is odd; rotary '
     'embeddings rotate pairs of dimensions, so choose an even head size.'),
    ([TINY, RUN, '--config.data.seq_len=128'], 2, 'data.seq_len=128 exceeds model.max_len=64; '
     'raise model.max_len or shorten data.seq_len.'),
    ([TINY, RUN, '--config.model.vocab_size=100'], 2, "model.vocab_size=100 is smaller than the "
     "tokenizer's 256 tokens; raise it or set it to -1."),
    ([TINY, RUN, '--config.data.document_masking=true'], 2, "data.document_masking=true needs "
     "the tokenizer's end-of-text id to find where documents end, but data.tokenizer='byte' has "
     "none; use a tokenizer with one (hf or sentencepiece), or set "
     "--config.data.document_masking=false."),
    # The mesh and the batch (8 devices).
    ([TINY, RUN, '--config.mesh.data=3'], 2, 'mesh: data*fsdp*tensor = 3*1*1 = 3, but there are 8 '
     'devices; make the product 8 or set one axis to -1.'),
    ([TINY, RUN, '--config.mesh.tensor=3'], 2, 'mesh: the fixed axes multiply to 3, which does not '
     'divide the 8 devices, so mesh.data=-1 has no size; choose sizes whose product divides 8.'),
    ([TINY, RUN, '--config.mesh.data=-1', '--config.mesh.fsdp=-1'], 2,
     "mesh: only one axis may be -1, got ['data', 'fsdp']; give the others sizes."),
    ([TINY, RUN, '--config.mesh.fsdp=0'], 2,
     'mesh.fsdp=0: axis sizes must be positive, or -1 for "the rest".'),
    ([TINY, RUN, '--config.mesh.tensor=8'], 2, 'model.num_heads=4 is not divisible by '
     'mesh.tensor=8; change one of them so that mesh.tensor divides model.num_heads.'),
    (['--config=experiments/tiny.py:mesh=1x8x1', RUN, '--config.model.embed_dim=36'], 2,
     'model.embed_dim=36 is not divisible by mesh.fsdp=8; change one of them so that mesh.fsdp '
     'divides model.embed_dim.'),
    ([TINY, RUN, '--config.data.global_batch_size=12'], 2, "data.global_batch_size=12 does not "
     "split over the mesh's batch axes data=8; make it a multiple of 8, or change the mesh."),
    ([TINY, RUN, '--config.train.microbatches=3'], 2, 'train.microbatches=3 does not divide the 2 '
     'rows each device holds (data.global_batch_size=16 over 8 batch shards); choose a divisor of '
     '2, or a larger batch.'),
    ([TINY, RUN, '--config.train.pipeline_repeats=2'], 2, 'train.pipeline_repeats=2: the circular '
     'pipeline schedule needs mesh.stage > 1; set it to 1, or split the mesh into stages.'),
    ([TINY, RUN, '--config.train.pipeline_schedule=1f1b'], 2, "train.pipeline_schedule='1f1b' "
     'needs pipeline stages, but mesh.stage=1; split the mesh into stages (mesh.stage > 1), or '
     'leave train.pipeline_schedule empty.'),
    ([TINY, RUN, '--config.train.pipeline_head=first_stage'], 2, "train.pipeline_head="
     "'first_stage' is unknown; choose 'split' or 'last_stage'."),
    (['--config=experiments/tiny.py:mesh=2x1x1x1x4', RUN, '--config.model.num_layers=8',
      '--config.train.pipeline_repeats=2', '--config.train.microbatches=6',
      '--config.data.global_batch_size=24', '--config.train.pipeline_schedule=interleaved_1f1b'],
     2, "train.pipeline_schedule='interleaved_1f1b' runs the micro-batches in groups of "
     'mesh.stage=4, but train.microbatches=6; make it a multiple of 4.'),
    (['--config=experiments/tiny.py:mesh=4x2x1', RUN, '--config.parallelism.rules=data_parallel'],
     2, "parallelism.rules='data_parallel' does not use mesh axes ['fsdp'] of size > 1, so they "
     'would only duplicate work; set them to 1 or pick rules that use them.'),
    (['--config=experiments/tiny.py:mesh=8x1x1', RUN, '--config.parallelism.rules=fsdp'], 2,
     "parallelism.rules='fsdp' splits parameters over mesh fsdp, which is 1: every device would "
     "hold them whole; give mesh.fsdp a size > 1, or set parallelism.rules='data_parallel'."),
    ([TINY, RUN, '--config.mesh.dcn_data=2'], 2, 'mesh.dcn_data*mesh.dcn_fsdp=2 must equal the '
     'number of processes (1), one group of devices per host; set them to 1 to let the mesh '
     'follow the device order.'),
    # The data.
    ([TINY, RUN, FILE], 2, "data.path='' is not set, but data.source='file' reads it; pass "
     '--config.data.path=PATH to a UTF-8 text file, or use --config.data.source=embedded.'),
    ([TINY, RUN, FILE, '--config.data.path=$T/no_such_file.txt'], 2,
     "data.path='$T/no_such_file.txt' does not exist; pass --config.data.path=PATH to a UTF-8 "
     'text file, or use --config.data.source=embedded.'),
    ([TINY, RUN, FILE, '--config.data.path=$T'], 2, "data.path='$T' is a directory, not a file; "
     'pass --config.data.path=PATH to a UTF-8 text file, or use --config.data.source=embedded.'),
    ([TINY, RUN, FILE, '--config.data.path=$T/latin1.txt'], 2, "data.path='$T/latin1.txt' is not "
     'UTF-8 text: byte 3 (0xe9, line 1, column 4) is not valid UTF-8; convert the file to UTF-8 '
     '(e.g. iconv -f latin1 -t utf-8) or pass another file.'),
    ([TINY, RUN, FILE, '--config.data.path=$T/empty.txt'], 2, "data.path='$T/empty.txt' is empty; "
     'pass a text file with the training text, or use --config.data.source=embedded.'),
    ([TINY, RUN, FILE, '--config.data.path=$T/short.txt'], 2, "data.path='$T/short.txt' holds 12 "
     'tokens, too few to split into train and validation parts of at least data.seq_len+2=66 '
     'tokens each (data.val_fraction=0.1: 651 tokens or more); use a larger source or a shorter '
     'data.seq_len.'),
    ([TINY, RUN, '--config.data.path=$T/short.txt'], 2, "data.path='$T/short.txt' is set but "
     "data.source='embedded' does not read files; add --config.data.source=file, or drop "
     'data.path.'),
    ([TINY, RUN, SHARDS, '--config.data.shards=$T/garbled_set'], 2, 'data.shards: '
     '$T/garbled_set/meta.json is not JSON (Expecting value: line 2 column 1 (char 12)); rerun '
     'python -m engine.data.prepare to write the set again.'),
    ([TINY, RUN, SHARDS, '--config.data.shards=$T/keyless_set'], 2, 'data.shards: '
     "$T/keyless_set/meta.json lacks 'dtype'; rerun python -m engine.data.prepare to write the "
     'set again.'),
    ([TINY, RUN, SHARDS, '--config.data.shards=$T/garbled_set:1,$T/keyless_set:nan'], 2,
     "data.shards='$T/garbled_set:1,$T/keyless_set:nan': weight nan of '$T/keyless_set' must be "
     'a finite number > 0; write DIR:WEIGHT, e.g. DIR:3.'),
    ([TINY, RUN, '--config.data.embedded_max_bytes=0'], 2,
     'data.embedded_max_bytes=0 must be positive.'),
    # The workdir, and the run to start from.
    ([TINY, '--workdir=$T/notes.txt'], 2, '--workdir=$T/notes.txt is a file, not a directory; pass '
     'a new path or the directory of the run to resume.'),
    ([TINY, '--workdir=s3://bucket/run'], 2, '--workdir=s3://bucket/run: s3:// is not supported; '
     'pass a local path or a gs:// URI.'),
    ([TINY, '--workdir=foo://x'], 2,
     '--workdir=foo://x: foo:// is not supported; pass a local path or a gs:// URI.'),
    ([TINY, '--workdir=$T/notes.txt/run'], 2, '--workdir=$T/notes.txt/run cannot be written (Not a '
     'directory); pass a path under a writable directory, or fix its permissions.'),
    ([TINY, RUN, '--config.train.init_from=$T/no_such_run'], 2, "train.init_from='$T/no_such_run' "
     'has no checkpoints/ directory; pass the --workdir of a run that saved a checkpoint.'),
    ([TINY, RUN, '--config.train.init_from=$T/unfinished_run'], 2,
     "train.init_from='$T/unfinished_run' holds no complete checkpoint; pass the --workdir of a "
     'run that saved one.'),
    # Found once the workdir is known to be a fresh run; it is left without a checkpoints/.
    ([TINY, RUN, '--config.train.init_from=$T/damaged_run'], 1,
     "train.init_from='$T/damaged_run': the checkpoint of step 2 is damaged: state/manifest.ocdbt "
     "is missing; put back an intact copy of its files, or pass another run's --workdir as "
     'train.init_from.'),
    # Hugging Face checkpoints.
    ([TINY, RUN, '--config.train.init_from=hf:$T/hf_yarn'], 2, 'train.init_from=hf:$T/hf_yarn: '
     "rope_parameters.rope_type='yarn' is not implemented; the engine computes default, linear, "
     'llama3 rotary frequencies.'),
    ([TINY, RUN, '--config.train.init_from=hf:$T/hf_window',
      '--config.model.attention=dot_product_attention'], 2, 'model.sliding_window=8 is shorter '
     "than data.seq_len=64, and model.attention='dot_product_attention' computes full causal "
     'attention, which differs from the window once a sequence is longer than it; use '
     "data.seq_len <= 8, or model.attention='einsum'."),
    ([TINY, RUN, '--config.train.init_from=hf:$T/hf_missing'], 2, 'train.init_from=hf:'
     "$T/hf_missing: 9 tensors are missing, e.g. 'model.layers.1.input_layernorm.weight' "
     '(config.json says num_hidden_layers=2; the files hold layers 0..0); the checkpoint is '
     'incomplete or its config.json names more layers than it holds.'),
    ([TINY, RUN, '--config.train.init_from=hf:$T/hf_jitter'], 2, 'train.init_from=hf:'
     "$T/hf_jitter: router_jitter_noise=0.01 is not supported (Mixtral multiplies the router's "
     'input by random noise while training; the engine does not); set it to 0.0 in config.json '
     'to fine-tune without it.'),
    ([TINY, RUN, '--config.train.init_from=hf:$T/hf_unnormalised'], 2, 'train.init_from=hf:'
     '$T/hf_unnormalised: norm_topk_prob=False is not supported (the top-k router weights used '
     "as they are); the engine's router renormalises them to sum to 1 "
     '(model.moe_router=softmax_topk): load a checkpoint with norm_topk_prob=true.'),
    ([TINY, RUN, '--config.train.init_from=hf:$T/hf_dense_layers'], 2, 'train.init_from=hf:'
     '$T/hf_dense_layers: decoder_sparse_step=2, mlp_only_layers=[], num_experts=4 make some '
     'layers dense; the engine stacks alike layers, every one a mixture of experts: load a '
     'checkpoint with decoder_sparse_step=1, mlp_only_layers=[].'),
    # Keys of the Llama family.
    ([TINY, RUN, '--config.model.name=llama', '--config.model.rope_type=yarn'], 2,
     "model.rope_type='yarn' is unknown; choose one of ('default', 'linear', 'llama3')."),
    ([TINY, RUN, '--config.model.qk_norm=true'], 2, "model.qk_norm=True is read by the llama model "
     "only; model.name='gpt' would ignore it: drop it."),
    ([TINY, RUN, '--config.model.attention_scale=0'], 2, 'model.attention_scale=0.0 must be a '
     'positive number, or -1 for 1/sqrt(head_dim).'),
    # Mixture of experts (Llama).
    ([TINY, RUN, '--config.model.num_experts=4'], 2, "model.num_experts=4 is read by the llama "
     "model only; model.name='gpt' would ignore it: drop it."),
    ([TINY, RUN, LLAMA, '--config.model.num_experts=-1'], 2, 'model.num_experts=-1 must be '
     '>= 0; give 0 for the dense MLP, or the number of experts.'),
    ([TINY, RUN, *MOE, '--config.model.experts_per_token=5'], 2,
     'model.experts_per_token=5 must lie in [1, model.num_experts=4]; route each token to at '
     'least one and at most every expert.'),
    ([TINY, RUN, *MOE, '--config.model.experts_per_token=0'], 2,
     'model.experts_per_token=0 must lie in [1, model.num_experts=4]; route each token to at '
     'least one and at most every expert.'),
    ([TINY, RUN, *MOE, '--config.model.moe_router=top1'], 2, "model.moe_router='top1' is "
     "unknown; choose one of ('softmax_topk', 'topk_softmax', 'sigmoid_topk')."),
    ([TINY, RUN, *MOE, '--config.model.moe_groups=2'], 2, "model.moe_groups, moe_topk_groups "
     "and moe_routed_scale are sigmoid_topk's; model.moe_router='softmax_topk' would ignore them: "
     'set --config.model.moe_router=sigmoid_topk, or leave them at 1, 1 and 1.0.'),
    ([TINY, RUN, *MOE, '--config.model.moe_router=sigmoid_topk', '--config.model.moe_groups=3'],
     2, 'model.moe_groups=3 must divide model.num_experts=4 into equal groups.'),
    ([TINY, RUN, *MOE, '--config.model.moe_router=sigmoid_topk', '--config.model.moe_groups=4',
      '--config.model.experts_per_token=2'], 2, 'model.moe_topk_groups=1 must lie in [1, '
     'model.moe_groups=4] and its groups hold at least model.experts_per_token=2 experts (1 per '
     'group).'),
    ([TINY, RUN, *MOE, '--config.model.moe_router=sigmoid_topk',
      '--config.model.moe_routed_scale=0'], 2, 'model.moe_routed_scale=0.0 must be a positive '
     'number (DeepSeek-V3: 2.5).'),
    ([TINY, RUN, LLAMA, '--config.model.mla_kv_rank=16', '--config.model.mla_rope_dim=3'], 2,
     'model.mla_rope_dim=3 must be a positive even number (rotary embeddings turn pairs of '
     'dimensions; DeepSeek-V3: 64).'),
    ([TINY, RUN, LLAMA, '--config.model.mla_kv_rank=16',
      '--config.model.attention=dot_product_attention'], 2,
     "model.mla_kv_rank=16 (multi-head latent attention) with "
     "model.attention='dot_product_attention': latent "
     'attention runs the einsum attention on whole sequences, scaled by 1 / sqrt(head_dim + '
     'mla_rope_dim), without q/k/v biases, q/k norms or a logit cap; drop that setting or set '
     'model.mla_kv_rank=0.'),
    ([TINY, RUN, LLAMA, '--config.model.mla_kv_rank=16', '--config.mesh.context=2',
      '--config.parallelism.mode=manual'], 2,
     'model.mla_kv_rank=16 (multi-head latent attention) with mesh.context=2: latent attention '
     'runs the einsum attention on whole sequences, scaled by 1 / sqrt(head_dim + mla_rope_dim), '
     'without q/k/v biases, q/k norms or a logit cap; drop that setting or set '
     'model.mla_kv_rank=0.'),
    ([TINY, RUN, LLAMA, '--config.model.attention_softcap=50',
      '--config.model.attention=dot_product_attention'], 2,
     "model.attention_softcap=50.0 with model.attention='dot_product_attention': only the einsum "
     "attention caps the logits; set model.attention='einsum'."),
    ([TINY, RUN, LLAMA, '--config.model.rope_local_base=10000'], 2,
     'model.rope_local_base=10000.0 needs model.global_every > 0 (which layers are local); set '
     'it, or model.rope_local_base=0.'),
    ([TINY, RUN, LLAMA, '--config.model.mlp_activation=relu'], 2,
     "model.mlp_activation='relu' is unknown; choose one of ('silu', 'gelu_tanh')."),
    ([TINY, RUN, *MOE, '--config.model.global_every=2'], 2,
     'model.global_every=2 with model.num_experts: local and global layers are built for the '
     'dense Llama attention and MLP; set model.global_every=0.'),
    ([TINY, RUN, *MOE, '--config.model.moe_balance=switch'], 2, "model.moe_balance='switch' "
     "is unknown; choose one of ('aux_loss', 'aux_free')."),
    ([TINY, RUN, *MOE, '--config.model.moe_balance=aux_free', '--config.model.moe_bias_rate=0'],
     2, "model.moe_bias_rate=0.0 must be a positive number under moe_balance='aux_free' "
     '(DeepSeek-V3: 0.001).'),
    ([TINY, RUN, LLAMA, '--config.model.moe_dense_layers=1'], 2,
     'model.moe_dense_layers=1 needs a mixture of experts after the dense layers; set '
     'model.num_experts, or moe_dense_layers=0.'),
    ([TINY, RUN, *MOE, '--config.model.moe_dense_layers=4'], 2,
     'model.moe_dense_layers=4 must lie in [0, model.num_layers=4); leave at least one '
     'mixture-of-experts layer.'),
    (['--config=experiments/tiny.py:mesh=4x1x1x1x2', RUN, *MOE,
      '--config.model.moe_dense_layers=1'], 2,
     'model.num_layers=4 less model.moe_dense_layers=1 (3 in the stack) does not split into '
     'mesh.stage=2 pipeline stages of equal depth; choose a stage count that divides it.'),
    ([TINY, RUN, *MOE, '--config.model.moe_dispatch=dense'], 2, "model.moe_dispatch='dense' "
     "is unknown; choose one of ('dropless', 'capacity')."),
    ([TINY, RUN, *MOE, '--config.model.moe_capacity_factor=0'], 2,
     'model.moe_capacity_factor=0.0 must be a positive number; each expert takes ceil(length * k '
     '/ experts * factor) assignments of each sequence (e.g. 1.25).'),
    ([TINY, RUN, *MOE, '--config.model.moe_aux_loss_coef=-0.1'], 2,
     'model.moe_aux_loss_coef=-0.1 must be a number >= 0; give 0 or more.'),
    (['--config=experiments/tiny.py:mode=manual,mesh=4x1x1x2', RUN, *MOE,
      '--config.model.moe_dispatch=capacity'], 2, "model.moe_dispatch='capacity' in manual mode "
     "with mesh.context=2 is not supported yet; use model.moe_dispatch='dropless', "
     'parallelism.mode=auto, or mesh.context=1.'),
    # The expert mesh axis.
    (['--config=experiments/tiny.py:mesh=2x1x1x1x1x4', RUN, LLAMA, '--config.model.num_experts=6'],
     2, 'model.num_experts=6 does not split over mesh.expert=4 devices; make mesh.expert a divisor '
     'of it (each device holds num_experts / expert experts).'),
    (['--config=experiments/tiny.py:mesh=2x1x1x1x1x4', RUN], 2, "mesh.expert=4 splits a mixture "
     "of experts, but model 'gpt' is dense (model.num_experts=0); set mesh.expert=1 (mesh.data "
     'splits the batch), or give the llama model experts.'),
]
