"""The command examples of the docs, and how the suite checks each
(tests/commands/test_doc_commands.py).

Examples come from the ```bash blocks of README.md and docs/*.md (a trailing backslash continues
a line, `&&` separates commands, `#` starts a comment) and from the `python -m` lines of the
experiments' docstrings. Each is keyed by its words joined with single spaces.

CHECKS maps every key to Run (run it, as written but for a visible reduction: flags appended
after its last word, /tmp/NAME paths moved into a scratch directory) or Skip (a stated reason).
Runs of one `chain` share a scratch directory and run in the table's order, so a generate or
evaluate reads the run an earlier command of its chain trained.
"""

import ast
import dataclasses
import os
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ('README.md', *sorted(f'docs/{p.name}' for p in (ROOT / 'docs').glob('*.md')))
PROGRAM_LINE = re.compile(r'^\s*(XLA_FLAGS=\S+\s+)?python -m ')
# What an example may set before `python`. Without it, a command runs on one CPU device, as
# on the 2-core machine the docs name (later XLA flags override earlier ones).
ALLOWED_ENV = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
ONE_DEVICE = ' --xla_force_host_platform_device_count=1'
# Reductions a user could type: a few steps, one eval batch.
SHORT_TRAIN = ('--config.train.num_steps=2', '--config.train.eval_every=2',
               '--config.train.eval_batches=1', '--config.train.log_every=1')


@dataclasses.dataclass(frozen=True)
class Run:
  chain: str  # Runs of one chain share a scratch directory, in the table's order.
  add: tuple[str, ...] = ()  # Appended after the command's last word.
  # (old word, new words) rewrites of whole flags; several new words are joined by spaces.
  replace: tuple[tuple[str, str], ...] = ()
  files: tuple[tuple[str, str], ...] = ()  # (name, text) written in the scratch first.
  outputs: tuple[str, ...] = ()  # Paths (after the /tmp move) the docs say it writes.
  order: int = 0  # Within a chain: lower first, then the table's order.


@dataclasses.dataclass(frozen=True)
class Skip:
  reason: str


SETUP = Skip('environment setup; CI runs it before the suite')
NO_HF = Skip('needs a downloaded Hugging Face checkpoint (/models/...)')
TRAINED_FROM_HF = Skip('reads a run trained from a Hugging Face checkpoint (/models/...)')
NO_TORCH = Skip('needs a Python with torch and transformers (--torch_python)')
NO_TRANSFORMERS = Skip('needs a Python with transformers (--transformers_python); the suite runs '
                       'it in its reference environment (tests/unit/test_tokenizer_export.py)')
NO_LIBTPU = Skip('needs libtpu\'s TPU compiler (the tpu extra) and compiles an 8B model')
ACCELERATOR = Skip('sized for accelerators: 153M parameters, sequence 1024, batch 64')
ACCELERATOR_500M = Skip('sized for accelerators: 0.5B parameters, sequence 2048, batch 8')
TINY_RUN = Skip('the same run as README\'s `python -m engine.main --config=experiments/tiny.py '
                '--workdir=/tmp/engine_tiny`, which runs')

CHECKS = {
    # README, "Quick start".
    'python3.11 -m venv .venv': SETUP,
    '. .venv/bin/activate': SETUP,
    'pip install -e .[test]': SETUP,
    'pip install -e .[test,tpu]': SETUP,
    'python -m tests.support.reference_envs': SETUP,
    'python -m pytest -q -n 2 --dist loadfile tests': Skip('the suite itself'),
    'python -m engine.main --config=experiments/tiny.py --workdir=/tmp/engine_tiny':
        Run('tiny', add=SHORT_TRAIN, outputs=('/tmp/engine_tiny/metrics.jsonl',
                                              '/tmp/engine_tiny/config.json')),
    # README, "Commands" (and the shakespeare_char docstring): train, then sample and evaluate.
    'python -m engine.main --config=experiments/shakespeare_char.py '
    '--config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/shakespeare':
        Run('shakespeare', add=SHORT_TRAIN, outputs=('/tmp/shakespeare/metrics.jsonl',
                                                     '/tmp/shakespeare/checkpoints')),
    'python -m engine.generate --workdir=/tmp/shakespeare --prompt=ROMEO:':
        Run('shakespeare', add=('--max_new_tokens=8',)),
    'python -m engine.generate --workdir=/tmp/shakespeare --prompts_file=prompts.txt '
    '--temperature=0.8 --top_k=40 --top_p=0.95 --seed=1 --num_samples=3 --max_new_tokens=40':
        Run('shakespeare', replace=(('--prompts_file=prompts.txt',
                                     '--prompts_file=/tmp/prompts.txt'),),
            files=(('prompts.txt', 'ROMEO:\nJULIET:\n'),)),
    'python -m engine.evaluate --workdir=/tmp/shakespeare': Run('shakespeare'),
    'python -m engine.evaluate --workdir=/tmp/shakespeare '
    '--text_file=experiments/data/tinyshakespeare.txt':  # All 1.1 MB: 80 s on 2 cores.
        Run('shakespeare', replace=(('--text_file=experiments/data/tinyshakespeare.txt',
                                     '--text_file=/tmp/shakespeare_head.txt'),),
            files=(('shakespeare_head.txt', 'First Citizen:\nBefore we proceed any further, '
                    'hear me speak.\n\nAll:\nSpeak, speak.\n' * 8),)),
    'python -m engine.main --config=experiments/finetune_hf.py:hf=/models/Qwen2.5-0.5B,steps=200 '
    '--config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/finetune': NO_HF,
    'XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.analysis.compare '
    '--config=experiments/shakespeare_char.py:mesh=2x2x2 '
    '--config.data.path=experiments/data/tinyshakespeare.txt --config.data.global_batch_size=16 '
    '--out=/tmp/compare --modes=auto,manual --steps=10':
        Run('compare', replace=(('--steps=10', '--steps=1'),), add=('--warmup=0',),
            outputs=('/tmp/compare/report.md', '/tmp/compare/report.json')),
    'XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.bench '
    '--config=experiments/llama_bench.py --modes=auto,manual '
    '--meshes=8x1x1,1x8x1,2x1x4,1x2x4,2x2x2 --steps=20 --out=/tmp/bench':
        Run('bench', replace=(('--meshes=8x1x1,1x8x1,2x1x4,1x2x4,2x2x2', '--meshes=2x2x2'),
                              ('--steps=20', '--steps=2')),
            outputs=('/tmp/bench.md', '/tmp/bench.json')),
    'XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.analysis.bubble '
    '--config=experiments/tiny.py:mesh=2x1x1x1x4 --config.model.num_layers=8 '
    '--config.train.microbatches=4 --config.train.pipeline_repeats=2 --microbatches=4,8,12,16':
        Run('bubble', replace=(('--microbatches=4,8,12,16', '--microbatches=4,5'),),
            add=('--modes=auto', '--steps=1', '--warmup=0')),
    'python -m engine.plan --config=experiments/llama_8b.py --topology=v5p:4x4x8 '
    '--meshes=8x16x1,1x32x4,1x16x1x1x8 --config.train.microbatches=8 --modes=auto,manual '
    '--out=/tmp/plan_8b': NO_LIBTPU,
    'python -m engine.bench.host_link --mib=256,1024':
        Skip('needs a TPU or GPU: a CPU\'s device memory is the host\'s (its refusal on CPU is a '
             'row of bad_inputs.md)'),
    'python -m engine.bench.loop_cost --config=experiments/shakespeare_char.py --rounds=5':
        Run('loop_cost', replace=(('--config=experiments/shakespeare_char.py',
                                   '--config=experiments/tiny.py'), ('--rounds=5', '--rounds=1')),
            add=('--steps=20',)),
    'python -m engine.bench.grouped_matmul':
        Run('grouped_matmul', add=('--rows=256', '--width=64', '--hidden=32', '--repeats=2')),
    'XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.analysis.show_layout '
    '--config=experiments/tiny.py:mesh=2x2x2 --param=blocks/w_qkv_CDHK': Run('show_layout'),
    # README, "Data": a BPE tokenizer, shards, a run on them.
    'python -m engine.data.train_tokenizer --input=embedded --vocab_size=4096 --out=/tmp/bpe.json':
        Run('bpe', outputs=('/tmp/bpe.json',)),
    'python -m engine.data.prepare --input=embedded --tokenizer=hf --tokenizer_path=/tmp/bpe.json '
    '--out=/tmp/stdlib_shards': Run('bpe', outputs=('/tmp/stdlib_shards/meta.json',)),
    'python -m engine.main --config=experiments/tiny.py --config.data.source=shards '
    '--config.data.shards=/tmp/stdlib_shards --config.data.tokenizer=hf --workdir=/tmp/tiny_bpe':
        Run('bpe', add=SHORT_TRAIN, outputs=('/tmp/tiny_bpe/metrics.jsonl',)),
    # docs/commands.md: lm-eval.
    'python -m engine.lm_eval --workdir=/tmp/sft --tasks=engine_arith_choice,engine_text_ppl '
    '--include_path=/tmp/lm_tasks --out=/tmp/sft_lm_eval':
        Skip('needs the lm_eval extra and an SFT run; tests/commands/test_lm_eval.py runs it in '
             'the reference environment'),
    # docs/commands.md: record files and a datasets directory.
    'python -m engine.data.prepare --input=/tmp/docs.jsonl --text_field=body --tokenizer=byte '
    '--out=/tmp/jsonl_shards':
        Run('records', files=(('docs.jsonl', '{"body": "a document", "id": 1}\n'
                                             '{"body": "another", "id": 2}\n'),),
            outputs=('/tmp/jsonl_shards/meta.json',)),
    'python -m engine.data.prepare --input=tests/support/datasets_dir --tokenizer=byte '
    '--out=/tmp/datasets_shards': Run('records', outputs=('/tmp/datasets_shards/meta.json',)),
    # README, "Export": a Llama run's checkpoint; /tmp/run is the llama_bench docstring's run.
    'python -m engine.export --workdir=/tmp/run --out=/tmp/run_hf':
        Run('llama', replace=(('--workdir=/tmp/run', '--workdir=/tmp/llama_bench'),),
            outputs=('/tmp/run_hf/config.json',), order=1),
    'python -m engine.analysis.hf_check --torch_python=/path/to/venv/bin/python --out=/tmp/hfc':
        NO_TORCH,
    'python -m engine.analysis.tokenizer_check --transformers_python=/path/to/venv/bin/python '
    '--text_file=experiments/data/tinyshakespeare.txt --out=/tmp/tok': NO_TRANSFORMERS,
    # README and docs/multihost.md, "Many processes".
    'python -m launch.local --num_processes=2 --devices_per_process=4 -- python -m engine.main '
    '--config=experiments/tiny.py:mesh=2x2x2,steps=100 --workdir=/tmp/tiny_2x4':
        Run('local', add=SHORT_TRAIN, outputs=('/tmp/tiny_2x4/metrics.jsonl',)),
    'python -m launch.tpu_pod --tpu=my-v5e-32 --zone=us-west4-a -- python -m engine.main '
    '--config=experiments/shakespeare_char.py:mesh=-1x1x1 '
    '--config.data.path=/data/tinyshakespeare.txt --workdir=gs://my-bucket/shakespeare':
        Run('launchers', replace=(('--zone=us-west4-a', '--zone=us-west4-a --dry_run'),)),
    'python -m launch.slurm --nodes=2 --gpus_per_node=8 --tasks=per_host --partition=gpu '
    '--setup=source .venv/bin/activate -- python -m engine.main '
    '--config=experiments/shakespeare_char.py:mesh=2x8x1 --config.mesh.dcn_data=2 '
    '--config.data.path=/shared/tinyshakespeare.txt --workdir=/shared/runs/s':
        # Without sbatch: --dry_run still checks the job against the experiment's mesh.
        Run('launchers', replace=(('--partition=gpu', '--partition=gpu --dry_run'),)),
    # README, "Sweeps": one variant of the grid's four, two steps.
    'python -m engine.sweep --config=experiments/tiny.py --config.train.num_steps=100 '
    '--grid=optim.learning_rate=1e-3,3e-3 --grid=model.num_layers=2,4 --workdir=/tmp/sweep':
        Run('sweep', replace=(('--config.train.num_steps=100', ' '.join(SHORT_TRAIN)),
                              ('--grid=optim.learning_rate=1e-3,3e-3',
                               '--grid=optim.learning_rate=1e-3'),
                              ('--grid=model.num_layers=2,4', '--grid=model.num_layers=2')),
            outputs=('/tmp/sweep/sweep.md', '/tmp/sweep/loss_curves.png',
                     '/tmp/sweep/optim.learning_rate=1e-3,model.num_layers=2/summary.json')),
    # docs/performance.md, docs/training.md.
    'python -m engine.bench --config=experiments/shakespeare_char.py '
    '--config.data.path=experiments/data/tinyshakespeare.txt --steps=40 '
    '--torch_python=/path/to/python-with-torch': NO_TORCH,
    'pip install tensorboard tensorboard-plugin-profile': SETUP,
    'tensorboard --logdir=WORKDIR/profile': Skip('a server, for a person to look at'),
    # Experiments' docstrings.
    'python -m engine.main --config=experiments/finetune_hf.py:hf=/models/Qwen2.5-0.5B '
    '--config.data.source=shards --config.data.shards=/tmp/shards --workdir=/tmp/finetune': NO_HF,
    'python -m engine.evaluate --workdir=/tmp/finetune '
    '--text_file=experiments/data/tinyshakespeare.txt': TRAINED_FROM_HF,
    'python -m engine.generate --workdir=/tmp/finetune --prompt=ROMEO: --max_new_tokens=50':
        TRAINED_FROM_HF,
    'python -m engine.export --workdir=/tmp/finetune --out=/tmp/finetune_hf': TRAINED_FROM_HF,
    'python -m engine.data.prepare --input=chats.jsonl --messages_field=messages --tokenizer=hf '
    '--tokenizer_path=/models/Qwen2.5-0.5B-Instruct/tokenizer.json --out=/tmp/chat_shards': NO_HF,
    'python -m engine.main --config=experiments/sft_hf.py:hf=/models/Qwen2.5-0.5B-Instruct,'
    'data=/tmp/chat_shards --workdir=/tmp/sft': NO_HF,
    'python -m engine.evaluate --workdir=/tmp/sft': TRAINED_FROM_HF,
    'python -m engine.export --workdir=/tmp/sft --out=/tmp/sft_hf': TRAINED_FROM_HF,
    'python -m engine.main --config=experiments/llama_124m.py:mesh=-1x1x1 '
    '--config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/llama_124m': ACCELERATOR,
    'python -m engine.main --config=experiments/llama_500m.py:mesh=-1x1x1 '
    '--workdir=/tmp/llama_500m': ACCELERATOR_500M,
    'python -m engine.data.train_tokenizer --input=experiments/data/tinyshakespeare.txt '
    '--vocab_size=2048 --out=/tmp/shakespeare_bpe.json':
        Run('prep_124m', outputs=('/tmp/shakespeare_bpe.json',)),
    'python -m engine.data.prepare --input=experiments/data/tinyshakespeare.txt --tokenizer=hf '
    '--tokenizer_path=/tmp/shakespeare_bpe.json --out=/tmp/shakespeare_shards':
        Run('prep_124m', outputs=('/tmp/shakespeare_shards/meta.json',)),
    'python -m engine.main --config=experiments/llama_124m.py:mesh=-1x1x1 '
    '--config.data.source=shards --config.data.shards=/tmp/shakespeare_shards '
    '--config.data.tokenizer=hf --workdir=/tmp/llama_124m_bpe': ACCELERATOR,
    'python -m engine.plan --config=experiments/llama_8b.py --topology=v5p:4x4x8 '
    '--meshes=8x16x1,1x32x4,1x16x1x1x8 --out=/tmp/plan_8b': NO_LIBTPU,
    'python -m engine.plan --config=experiments/llama_8b.py --topology=v5p:4x4x8 '
    '--config.model.attention=splash --search --top=4 --out=/tmp/search_8b': NO_LIBTPU,
    # experiments/mixtral_8x7b.py (BUILD.md has its plan table).
    'python -m engine.plan --config=experiments/mixtral_8x7b.py --topology=v5p:4x4x8 '
    '--meshes=1x16x1x1x1x8,4x4x1x1x1x8,1x128x1 --modes=auto,manual --out=/tmp/plan_mixtral':
        Skip('needs libtpu\'s TPU compiler (the tpu extra) and compiles a 47B model for 128 '
             'chips (18 min)'),
    # experiments/llama_70b.py (BUILD.md has its plan table).
    'python -m engine.plan --config=experiments/llama_70b.py --topology=v5p:16x16x16 '
    '--meshes=1x256x16 --modes=auto,manual --out=/tmp/plan_70b':
        Skip('needs libtpu\'s TPU compiler (the tpu extra) and compiles a 70B model for 4096 '
             'chips (5 min)'),
    'XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.main '
    '--config=experiments/llama_bench.py:mesh=2x2x2,mode=manual --workdir=/tmp/llama_bench':
        Run('llama', add=SHORT_TRAIN, outputs=('/tmp/llama_bench/metrics.jsonl',)),
    'XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m engine.main '
    '--config=experiments/shakespeare_char.py:mesh=2x2x2 '
    '--config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/shakespeare_222':
        Run('shakespeare_222', add=SHORT_TRAIN,
            outputs=('/tmp/shakespeare_222/metrics.jsonl',)),
    'python -m engine.main --config=experiments/tiny.py --workdir=/tmp/tiny': TINY_RUN,
}


def key(words: list[str]) -> str:
  return ' '.join(words)


def _commands_of(line: str) -> list[list[str]]:
  """One shell line -> each command's words (a comment dropped, `&&` splits)."""
  commands, current = [], []
  for word in shlex.split(line, comments=True) + ['&&']:
    if word != '&&':
      current.append(word)
    elif current:
      commands.append(current)
      current = []
  return commands


def _split_lines(text: str) -> list[str]:
  """Joins backslash-continued lines; one logical line each."""
  return [line for line in text.replace('\\\n', ' ').splitlines() if line.strip()]


def from_markdown(path: str) -> list[tuple[str, list[str]]]:
  text = (ROOT / path).read_text()
  blocks = re.findall(r'^```bash\n(.*?)^```', text, flags=re.M | re.S)
  return [(path, words) for block in blocks for line in _split_lines(block)
          for words in _commands_of(line)]


def from_docstring(path: str) -> list[tuple[str, list[str]]]:
  doc = ast.get_docstring(ast.parse((ROOT / path).read_text())) or ''
  return [(path, words) for line in doc.splitlines() if PROGRAM_LINE.match(line)
          for words in _commands_of(line)]


def extract() -> list[tuple[str, list[str]]]:
  """(source file, words) of every command example, in document order."""
  found = [c for path in DOCS for c in from_markdown(path)]
  experiments = sorted(f'experiments/{p.name}' for p in (ROOT / 'experiments').glob('*.py'))
  return found + [c for path in experiments for c in from_docstring(path)]


def reduced(words: list[str], check: Run, scratch: str) -> tuple[dict, list[str]]:
  """The command as run: (environment to add to the test process's, argv after `python -m`)."""
  env = {'XLA_FLAGS': os.environ.get('XLA_FLAGS', '') + ONE_DEVICE}
  while '=' in words[0] and not words[0].startswith('-'):
    name, value = words[0].split('=', 1)
    assert ALLOWED_ENV.get(name) == value, f'unsupported prefix {words[0]}; support it here'
    env[name] = os.environ.get(name, '') + ' ' + value
    words = words[1:]
  assert words[:2] == ['python', '-m'], words
  replace = dict(check.replace)  # A replacement may be several words, joined by spaces.
  words = [x for w in words[2:] for x in (replace[w].split(' ') if w in replace else [w])]
  words += list(check.add)
  return env, [move_tmp(w, scratch) for w in words]


def move_tmp(text: str, scratch: str) -> str:
  """/tmp/ paths into the scratch (the docs' data file, experiments/data/, is the checkout's)."""
  return re.sub(r'(?<![\w.])/tmp/', f'{scratch}/', text)
