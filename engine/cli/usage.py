"""What `--help` prints: each command's usage line and what it does, for its user.

absl's own --help prints the `__main__` module's docstring (notes for the engine's developers)
and exits with status 1; `show_help` prints this instead, then the command's flags, and
`engine.cli.command_line.parse_flags` exits 0 after it.
"""

from __future__ import annotations

import sys
import textwrap

from absl import flags

# program: (usage, what it does, the section of docs/commands.md that has the rest).
COMMANDS = {
    'engine.main': (
        'python -m engine.main --config=EXPERIMENT[:ARGS] [--config.KEY=VALUE ...] --workdir=DIR',
        'Trains an experiment (a file in experiments/, e.g. experiments/tiny.py) and writes its '
        'checkpoints, metrics and samples to DIR. Rerunning the same command resumes from the '
        'latest checkpoint; --print_config lists every config key with its value and help.',
        'Training and resuming'),
    'engine.generate': (
        'python -m engine.generate --workdir=RUN --prompt=TEXT',
        'Samples text from the latest checkpoint of the training run RUN, continuing each prompt '
        '(temperature 0.8 among the 200 likeliest tokens by default; --temperature=0: greedy).',
        'Sampling'),
    'engine.evaluate': (
        'python -m engine.evaluate --workdir=RUN [--text_file=FILE]',
        'Prints the loss, perplexity and bits per byte of the latest checkpoint of the training '
        'run RUN, on its held-out split or on a text file.',
        'Evaluating a checkpoint'),
    'engine.lm_eval': (
        'python -m engine.lm_eval --workdir=RUN --tasks=TASK,... [--include_path=DIR]',
        "Scores the latest checkpoint of the training run RUN on lm-eval's tasks (the lm_eval "
        'extra), on its own compiled forward pass and generator.',
        'Benchmarks with lm-eval'),
    'engine.export': (
        'python -m engine.export --workdir=RUN --out=DIR',
        'Writes the latest checkpoint of the Llama-family training run RUN as a Hugging Face '
        'checkpoint (model and tokenizer) in DIR.',
        'Exporting to Hugging Face'),
    'engine.bench': (
        'python -m engine.bench --config=EXPERIMENT [--modes=auto,manual] [--meshes=M1,M2] '
        '[--out=PREFIX]',
        'Times the training step of every mode and mesh side by side and prints a table '
        '(written to PREFIX.md and PREFIX.json with --out).',
        'Timing modes and meshes'),
    'engine.bench.host_link': (
        'python -m engine.bench.host_link [--mib=256,1024] [--repeats=7]',
        'Times the link between a TPU or GPU and host memory as an offloaded optimizer state '
        'uses it (host -> chip -> host, the host buffer donated) and prints a table.',
        'The link to host memory'),
    'engine.bench.loop_cost': (
        'python -m engine.bench.loop_cost --config=EXPERIMENT [--steps=300] [--rounds=3]',
        'Measures what the training loop costs per step beyond its compiled step: a real run\'s '
        'step time against the compiled step alone, in alternating rounds, and prints a table.',
        'The loop\'s own cost'),
    'engine.plan': (
        'python -m engine.plan --config=EXPERIMENT --topology=VERSION:SHAPE [--meshes=M1,M2] '
        '[--out=PREFIX]',
        'Compiles the training step for a TPU topology on each candidate mesh and mode, without '
        'the chips, and ranks them by memory and communication.',
        'Planning a pod run'),
    'engine.sweep': (
        'python -m engine.sweep --config=EXPERIMENT --grid=KEY=V1,V2 [--grid=...] --workdir=DIR',
        'Trains every combination of the grid\'s values, one run each in DIR/<variant>, and '
        'tabulates them; rerunning resumes the sweep.',
        'Sweeps'),
    'engine.analysis.compare': (
        'python -m engine.analysis.compare --config=EXPERIMENT --out=DIR [--modes=auto,manual]',
        'Runs the modes side by side from the same state on the same batches, next to a '
        'single-device reference: numerics, speed, memory and collectives, printed and written '
        'to DIR.',
        'Comparing the modes'),
    'engine.analysis.bubble': (
        'python -m engine.analysis.bubble --config=EXPERIMENT --microbatches=M1,M2,...',
        'Measures a pipeline\'s bubble: the step time against the number of micro-batches.',
        'The pipeline bubble'),
    'engine.analysis.show_layout': (
        'python -m engine.analysis.show_layout --config=EXPERIMENT [--param=NAME]',
        'Shows where every parameter and the input batch live on the mesh.',
        'The layout'),
    'engine.analysis.hf_check': (
        'python -m engine.analysis.hf_check --torch_python=PYTHON [--out=PREFIX]',
        'Checks the Hugging Face import and export of every model family against transformers, '
        'run by a Python that has torch and transformers.',
        'Checking against transformers'),
    'engine.analysis.tokenizer_check': (
        'python -m engine.analysis.tokenizer_check --transformers_python=PYTHON [--out=PREFIX]',
        "Checks that transformers' AutoTokenizer gives the engine's ids for every exported "
        'tokenizer kind and architecture, run by a Python that has transformers.',
        'Checking against transformers'),
    'engine.data.train_tokenizer': (
        'python -m engine.data.train_tokenizer --input=TEXT --vocab_size=N --out=FILE',
        'Trains a byte-level BPE tokenizer on text files (or the embedded corpus) and writes its '
        'tokenizer.json.',
        'Tokenizers and shards'),
    'engine.data.prepare': (
        'python -m engine.data.prepare --input=TEXT --tokenizer=KIND --tokenizer_path=FILE '
        '--out=DIR',
        'Tokenizes text (files, JSON lines, Parquet, datasets directories) once into ArrayRecord '
        'shards for --config.data.source=shards.',
        'Tokenizers and shards'),
}


def _flag_lines() -> str:
  """The command's own flags, one entry each: those its `__main__` defines and those the engine
  defines for it (absl files a flag under the module whose call defined it)."""
  own = {flag.name: flag for module, found in flags.FLAGS.flags_by_module_dict().items()
         if module == sys.argv[0] or module.startswith('engine') for flag in found}
  lines = []
  for name, flag in sorted(own.items()):
    shown = f'--[no]{name}' if flag.boolean else f'--{name}'
    default = '' if flag.default is None else f' (default: {flag.default_as_str})'
    lines.append(textwrap.fill(f'{shown}: {flag.help}{default}', 96, initial_indent='  ',
                               subsequent_indent='      '))
  return '\n'.join(lines)


def help_text(program: str, full: bool = False) -> str:
  """The usage line, what the command does, and its flags (`full`: every flag, the libraries'
  too)."""
  usage, about, section = COMMANDS[program]
  if full:
    listing = f'flags, the libraries\' too:\n{flags.FLAGS.get_help()}'
  else:
    listing = f'flags (--helpfull: the libraries\' too):\n{_flag_lines()}'
  return (f'usage: {usage}\n\n{textwrap.fill(about, 96)}\n\n{listing}\n\nMore: docs/commands.md, '
          f'"{section}".\n')


def show_help(program: str, full: bool = False) -> None:
  sys.stdout.write(help_text(program, full))
  sys.stdout.flush()
