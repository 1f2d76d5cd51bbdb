"""Bad input to every command but engine.main (whose rows are tests/support/bad_inputs_main.py):
for each program, the command lines a user could type, with the exit status and the one line,
`error: ...`, each gets. tests/commands/test_command_bad_inputs.py runs them; docs/bad_inputs.md
lists them.

`$T` stands for the row's own scratch directory, holding COMMAND_SCRATCH's files; `$RUN` for a
finished two-step training run of a tiny Llama (byte tokenizer, data.seq_len=64, 4 heads), which
no row may change.
"""

import json

from engine.config import default_config
from tests.support.bad_inputs_launchers import LAUNCHER_ROWS


def _moe_run() -> str:
  """A config.json of a run of a mixture-of-experts Llama (byte tokenizer) whose router no
  Hugging Face architecture has."""
  saved = json.loads(default_config().to_json())
  saved['model'].update(name='llama', num_experts=4, moe_router='topk_softmax')
  return json.dumps(saved)


def _kept_run(sha256: str) -> str:
  """A run's config.json whose record of the kept tokenizer (engine/workdir/tokenizer.py) has
  `sha256`."""
  saved = json.loads(default_config().to_json())
  saved['tokenizer'] = {'kind': 'hf', 'file': 'tokenizer/tokenizer.json', 'sha256': sha256}
  return json.dumps(saved)


def _old_char_run() -> str:
  """The config.json of a run of a character vocabulary on a text file that is gone since, from
  before runs kept their vocabulary (no tokenizer record)."""
  saved = json.loads(default_config().to_json())
  saved['data'].update(source='file', tokenizer='char', path='no_such_corpus.txt')
  return json.dumps(saved)


# What each row's scratch directory $T holds (text, or bytes).
COMMAND_SCRATCH = {
    'notes.txt': 'keep me',
    'empty.txt': '',
    'latin1.txt': b'caf\xe9 au lait\n',  # Latin-1, not UTF-8.
    'short.txt': 'To be, or not to be.\n',  # 21 bytes: fewer tokens than one window.
    'long_prompt.txt': 'a prompt of a good forty-odd characters or so\n',
    'not_a_run/config.json': '{"model": {}}',  # A config.json no training run wrote.
    'garbled_run/config.json': '{"model": ',
    # Runs whose kept tokenizer is gone, or not the one config.json records.
    'lost_tokenizer_run/config.json': _kept_run('0' * 64),
    'damaged_tokenizer_run/config.json': _kept_run('0' * 64),
    'damaged_tokenizer_run/tokenizer/tokenizer.json': '{}',
    'moe_run/config.json': _moe_run(),
    'old_char_run/config.json': _old_char_run(),
    'hf_export/config.json': '{}',  # What an earlier export left: replaced whole, not refused.
    'not_executable.sh': 'echo hi\n',
    'hello.txt': 'hello world\n',
    'records.jsonl': '{"body": "a document", "id": 1}\n',
    'null_record.jsonl': '{"text": "a document"}\n{"text": null}\n',
    'chats.jsonl': '{"messages": [{"role": "user", "content": "hi"}]}\n',
    'empty_dir/': None,
    'other/notes.txt': 'keep me',
    'old_set/meta.json': '{}',  # An earlier shard set (prepare refuses to replace it silently).
}

RUN = '--workdir=$RUN'
TINY = '--config=experiments/tiny.py'
SWEEP = '--workdir=$T/sweep'
PIPELINE = '--config=experiments/tiny.py:mesh=2x1x1x1x4'
V5P = '--topology=v5p:2x2x2'
HF_CHECK = '--torch_python=/bin/true'  # Never run: the rows fail first.
TOKENIZER_CHECK = '--transformers_python=/bin/true'  # Never run: the rows fail first.
MESH_FORMAT = ('a mesh is DATAxFSDPxTENSOR[xCONTEXT[xSTAGE[xEXPERT]]], 3 to 6 integers joined by '
               'x (axes not given are 1); e.g. 2x2x2, 2x1x1x2x2 for context 2 and stage 2, or '
               '1x1x1x1x1x4 for expert 4 (-1: the devices the other axes leave, e.g. -1x1x2).')
OLD_CHAR_RUN = ("--workdir=$T/old_char_run: the run's text, data.path='no_such_corpus.txt', does "
                'not exist; ')
UNSUPPORTED = 'is not supported; pass a local path or a gs:// URI.'
NOT_A_RUN = ('$T/not_a_run: config.json has no data section; it is not a config a training run '
             'wrote: restore it, or pass the --workdir of a training run.')
UTF8 = ('is not UTF-8 text: byte 3 (0xe9, line 1, column 4) is not valid UTF-8; convert the file '
        'to UTF-8 (e.g. iconv -f latin1 -t utf-8) or pass another file.')

# {program: [(argv without the program, exit status, the line on stderr after `error: `)]}.
COMMAND_ROWS = {
    'engine.generate': [
        ([], 2, '--workdir is required: The training run to sample from.'),
        ([RUN], 2, 'give --prompt="..." or --prompts_file=FILE.'),
        ([RUN, '--prompt=hi', '--max_new_tokens=-1'], 2, "--max_new_tokens=-1 must be >= 0 (0: "
         "100, or what a GPT model's learned positions leave)."),
        ([RUN, '--prompt=hi', '--max_prompt_len=-1'], 2,
         "--max_prompt_len=-1 must be >= 0 (0: the longest prompt's length)."),
        ([RUN, '--prompt=hi', '--num_samples=0'], 2, '--num_samples=0 must be at least 1.'),
        ([RUN, '--prompt=hi', '--temperature=-1'], 2,
         '--temperature=-1 must be a finite number >= 0 (0: greedy).'),
        ([RUN, '--prompt=hi', '--temperature=inf'], 2,
         '--temperature=inf must be a finite number >= 0 (0: greedy).'),
        ([RUN, '--prompt=hi', '--top_k=-3'], 2, '--top_k=-3 must be >= 0 (0: every token).'),
        ([RUN, '--prompt=hi', '--top_p=0'], 2, '--top_p=0 must lie in (0, 1] (1: every token).'),
        ([RUN, '--prompt=hi', '--top_p=nan'], 2,
         '--top_p=nan must lie in (0, 1] (1: every token).'),
        ([RUN, '--prompt=hi', '--max_new_tokens=ten'], 2,
         '--max_new_tokens=ten is not an integer; give one, e.g. --max_new_tokens=0.'),
        ([RUN, '--prompt=hi', '--mesh=2x'], 2, f'--mesh=2x: {MESH_FORMAT}'),
        ([RUN, '--prompt=hi', '--mesh=1x1x3'], 2, 'model.num_heads=4 is not divisible by '
         'mesh.tensor=3; change one of them so that mesh.tensor divides model.num_heads.'),
        ([RUN, '--prompt=hi', '--mesh=16x1x1'], 2, 'mesh: data*fsdp*tensor = 16*1*1 = 16, but '
         'there are 8 devices; make the product 8 or set one axis to -1; on CPU, simulate 16 '
         'devices by starting the command with '
         'XLA_FLAGS=--xla_force_host_platform_device_count=16.'),
        ([RUN, '--prompts_file=$T/no_such_file.txt'], 2,
         '--prompts_file=$T/no_such_file.txt does not exist; pass another file.'),
        ([RUN, '--prompts_file=$T'], 2,
         '--prompts_file=$T is a directory, not a file; pass another file.'),
        ([RUN, '--prompts_file=$T/latin1.txt'], 2, f'--prompts_file=$T/latin1.txt {UTF8}'),
        ([RUN, '--prompts_file=$T/empty.txt'], 2,
         'give --prompt="..." or --prompts_file=FILE (one prompt a line; it holds none).'),
        ([RUN, '--prompts_file=$T/long_prompt.txt', '--max_prompt_len=8'], 2,
         'a prompt has 45 tokens, more than --max_prompt_len=8; raise --max_prompt_len or '
         'shorten the prompt.'),
        (['--workdir=$T/no_such_run', '--prompt=hi'], 2, '--workdir=$T/no_such_run holds no '
         'config.json; pass the --workdir of a training run.'),
        (['--workdir=$T/not_a_run', '--prompt=hi'], 2, f'--workdir={NOT_A_RUN}'),
        (['--workdir=$T/garbled_run', '--prompt=hi'], 2, '--workdir=$T/garbled_run: config.json '
         'is not valid JSON (Expecting value: line 1 column 11 (char 10)); it is not a file a '
         'training run wrote: restore it, or pass another --workdir.'),
        (['--workdir=$T/lost_tokenizer_run', '--prompt=hi'], 2,
         "--workdir=$T/lost_tokenizer_run: config.json records the run's tokenizer in "
         '$T/lost_tokenizer_run/tokenizer/tokenizer.json, which is missing; restore it (a copy '
         'of the tokenizer file the run trained with), or pass the --workdir of a complete run.'),
        (['--workdir=$T/damaged_tokenizer_run', '--prompt=hi'], 2,
         '--workdir=$T/damaged_tokenizer_run: $T/damaged_tokenizer_run/tokenizer/tokenizer.json '
         "does not match the SHA-256 that config.json records for the run's tokenizer; restore "
         'the file the run trained with.'),
        (['--workdir=$T/old_char_run', '--prompt=hi'], 2, f"{OLD_CHAR_RUN}the workdir keeps no "
         "copy of the run's character vocabulary (the run predates the copy), so it is read from "
         'that text: put the file back at that path.'),
        (['--workdir=s3://bucket/run', '--prompt=hi'], 2,
         f'--workdir=s3://bucket/run: s3:// {UNSUPPORTED}'),
        ([RUN, '--prompt=hi', 'extra'], 2, "unexpected arguments ['extra']; everything is given "
         'as a flag, --name=value.'),
        ([RUN, '--promt=hi'], 2, '--promt is not a flag (did you mean --prompt?); python -m '
         'engine.generate --helpfull lists them.'),
    ],
    'engine.lm_eval': [
        ([], 2, '--workdir is required: The training run to evaluate.'),
        ([RUN, '--tasks=hellaswag'], 2, 'engine.lm_eval needs the lm_eval package, which is not '
         'installed; pip install -e ".[lm_eval]" (or pip install lm_eval).'),
    ],
    'engine.evaluate': [
        ([RUN, '--eval_batches=0'], 2, "--eval_batches=0 must be at least 1 (or leave it out: "
         "the run's train.eval_batches)."),
        ([RUN, '--eval_batches=2', '--text_file=$T/short.txt'], 2, '--eval_batches=2 counts '
         'held-out batches, but --text_file=$T/short.txt is scored whole; drop one of them.'),
        ([RUN, '--text_file=$T/no_such_file.txt'], 2,
         '--text_file=$T/no_such_file.txt does not exist; pass another file.'),
        ([RUN, '--text_file=$T'], 2, '--text_file=$T is a directory, not a file; pass another '
         'file.'),
        ([RUN, '--text_file=$T/latin1.txt'], 2, f'--text_file=$T/latin1.txt {UTF8}'),
        ([RUN, '--text_file=$T/empty.txt'], 2, "--text_file=$T/empty.txt holds 0 tokens, fewer "
         "than one window of the run's data.seq_len + 1 = 65; pass a longer text."),
        ([RUN, '--text_file=$T/short.txt'], 2, "--text_file=$T/short.txt holds 21 tokens, fewer "
         "than one window of the run's data.seq_len + 1 = 65; pass a longer text."),
        ([RUN, '--text_file=$T/short.txt', '--batch=0'], 2, '--batch=0 must be at least 1.'),
        ([RUN, '--text_file=$T/short.txt', '--mesh=3x'], 2, f'--mesh=3x: {MESH_FORMAT}'),
        (['--workdir=$T/not_a_run', '--text_file=$T/short.txt'], 2, f'--workdir={NOT_A_RUN}'),
        (['--workdir=$T/old_char_run'], 2,
         f'{OLD_CHAR_RUN}the held-out split is read from it: put the file back at that path.'),
        (['--workdir=foo://x'], 2, f'--workdir=foo://x: foo:// {UNSUPPORTED}'),
    ],
    'engine.export': [
        ([RUN], 2, '--out is required: Directory to write.'),
        (['--out=$T/export'], 2, '--workdir is required: The training run to export.'),
        (['--workdir=$T/moe_run', '--out=$T/export'], 2,
         "--workdir=$T/moe_run trained model.moe_router='topk_softmax' (MixtralForCausalLM "
         'routes softmax_topk: a softmax over every expert, the top k renormalised), which '
         'a Hugging Face export cannot write as MixtralForCausalLM; use the run with engine.generate and '
         'engine.evaluate.'),
        ([RUN, '--out='], 2, '--out is empty; pass the directory to write, e.g. '
         '--out=/tmp/hf_export.'),
        ([RUN, '--out=$T/notes.txt'], 2, '--out=$T/notes.txt is a file; pass a directory to '
         'write.'),
        ([RUN, '--out=$T'], 2, "--out=$T holds 20 entries that are not a Hugging Face "
         "checkpoint's, e.g. 'chats.jsonl'; pass a new or empty directory (an earlier "
         'export there is replaced whole).'),
        ([RUN, '--out=$T/notes.txt/export'], 2, '--out=$T/notes.txt/export: $T/notes.txt is not '
         'a directory this process can write (the export is staged beside --out, then renamed); '
         'pass a path in one.'),
        ([RUN, '--out=$T/export', '--dtype=int8'], 2,
         '--dtype=int8: value should be one of <float32|bfloat16|float16>.'),
        ([RUN, '--out=$T/export', '--format=gguf'], 2,
         '--format is not a flag; python -m engine.export --helpfull lists them.'),
        (['--workdir=$T/no_such_run', '--out=$T/export'], 2, '--workdir=$T/no_such_run holds no '
         'config.json; pass the --workdir of a training run.'),
        (['--workdir=$T/garbled_run', '--out=$T/export'], 2, '--workdir=$T/garbled_run: '
         'config.json is not valid JSON (Expecting value: line 1 column 11 (char 10)); it is not '
         'a file a training run wrote: restore it, or pass another --workdir.'),
        (['--workdir=s3://bucket/run', '--out=$T/export'], 2,
         f'--workdir=s3://bucket/run: s3:// {UNSUPPORTED}'),
    ],
    'engine.bench.host_link': [
        ([], 2, "cpu devices have no link to host memory to measure (a CPU's device memory is the "
         "host's); run this on a TPU or GPU."),
        (['--mib=256,0'], 2, '--mib=256,0 must list positive integers (MiB) and --repeats=7 be '
         'at least 1.'),
    ],
    'engine.bench.loop_cost': [
        ([], 2, '--config is required: Experiment config file.'),
        ([TINY, '--steps=5'], 2, '--steps=5 must be at least 20 (10 log intervals of 2 steps) and '
         '--rounds=3 at least 1.'),
    ],
    'engine.bench': [
        ([], 2, '--config is required: Experiment config file.'),
        ([TINY, '--modes=bogus'], 2, "--modes='bogus' is unknown; choose one of ['auto', "
         "'manual']."),
        ([TINY, '--modes='], 2, "--modes is empty; choose one or more of ['auto', 'manual']."),
        ([TINY, '--steps=0'], 2, '--steps=0 must be >= 1 and --warmup=2 >= 0.'),
        ([TINY, '--warmup=-1'], 2, '--steps=20 must be >= 1 and --warmup=-1 >= 0.'),
        ([TINY, '--meshes=2x'], 2, f'--meshes=2x: {MESH_FORMAT}'),
        ([TINY, '--meshes=3x1x1'], 2, 'mesh: data*fsdp*tensor = 3*1*1 = 3, but there are 8 '
         'devices; make the product 8 or set one axis to -1.'),
        ([TINY, '--peak_tflops=-1'], 2,
         "--peak_tflops=-1 must be a positive number (one device's peak, TFLOP/s)."),
        ([TINY, '--baseline=$T/empty_dir'], 2, '--baseline=$T/empty_dir is not a checkout of the '
         'engine (no $T/empty_dir/engine/__init__.py); give the root of one, e.g. a git worktree: '
         'git worktree add --detach /tmp/before HEAD'),
        ([TINY, '--out=$T/no_such_dir/report'], 2, '--out=$T/no_such_dir/report: '
         '$T/no_such_dir is not a directory; create it, or pass a prefix in one.'),
        ([TINY, '--out=$T/'], 2, '--out=$T/ is not a file prefix; give one, e.g. '
         '--out=/tmp/report for /tmp/report.md and /tmp/report.json.'),
        ([TINY, '--profile=$T/notes.txt'], 2, '--profile=$T/notes.txt is not a directory; give '
         'one (it is created if missing), e.g. --profile=/tmp/bench_profile.'),
        # /bin/true passes the torch check (`true -c 'import torch'` exits 0), so the next one
        # speaks.
        ([TINY, '--config.model.name=llama', '--torch_python=/bin/true'], 2,
         '--torch_python: the PyTorch reference is the GPT model on one device.'),
        ([TINY, '--torch_python=python3'], 2, "--torch_python=python3 cannot import torch "
         "(ModuleNotFoundError: No module named 'torch'); install it into that Python (python3 "
         "-m pip install torch), or point --torch_python at a Python that has it."),
        ([TINY, '--torch_python=$T/no_such_python'], 2, '--torch_python=$T/no_such_python cannot '
         'be run (No such file or directory); give the path of a Python that has torch, e.g. '
         '--torch_python=/opt/torch-venv/bin/python.'),
        ([TINY, '--dense_equivalent'], 2, '--dense_equivalent: the config is not a mixture of '
         'experts (model.num_experts=0); set model.num_experts, or drop the flag.'),
        ([TINY, '--config.optim.b2=1.5'], 2, 'optim.b2=1.5 must lie in [0, 1): it is how much of '
         'its running average Adam keeps each step (usual: b1=0.9, b2 from 0.95 to 0.999).'),
    ],
    'engine.sweep': [
        ([], 2, '--config is required: Experiment config file, optionally with :arg.'),
        ([TINY], 2, '--workdir is required: Directory of the sweep: one workdir per variant, '
         'sweep.json, the table and the plot; rerun with it to resume.'),
        ([TINY, SWEEP], 2, 'give at least one --grid=KEY=V1,V2,..., e.g. '
         '--grid=optim.learning_rate=1e-3,3e-3.'),
        ([TINY, SWEEP, '--grid=optim.learning_rat=1e-3'], 2, '--grid=optim.learning_rat=1e-3: the '
         'config has no key optim.learning_rat (did you mean optim.learning_rate?); the keys are '
         'in engine/config.py, default_config() (and mode, mesh).'),
        ([TINY, SWEEP, '--grid=optim=1'], 2, '--grid=optim=1: optim is a section of the config, '
         'not a value; sweep its keys one by one.'),
        ([TINY, SWEEP, '--grid=optim.learning_rate'], 2, '--grid=optim.learning_rate is not '
         'KEY=V1,V2,...; e.g. --grid=optim.learning_rate=1e-3,3e-3.'),
        ([TINY, SWEEP, '--grid=optim.learning_rate=1e-3,,2e-3'], 2, '--grid=optim.learning_rate='
         '1e-3,,2e-3 has an empty value; list values separated by single commas, e.g. '
         '--grid=optim.learning_rate=A,B.'),
        ([TINY, SWEEP, '--grid=mode=auto,auto'], 2,
         '--grid=mode=auto,auto lists a value twice; list each value once.'),
        ([TINY, SWEEP, '--grid=mode=auto', '--grid=mode=manual'], 2, '--grid: mode is given '
         'twice; give all its values in one flag, --grid=mode=V1,V2,....'),
        ([TINY, SWEEP, '--grid=optim.learning_rate=1e-3,abc'], 2, '--grid: '
         "optim.learning_rate=abc is not a number; give values of the key's type, e.g. "
         'optim.learning_rate=0.001.'),
        ([TINY, SWEEP, '--grid=mesh=8x1x1,2x'], 2, f'--grid: mesh=2x: {MESH_FORMAT}'),
        ([TINY, SWEEP, '--grid=mesh=8x1x1,16x1x1'], 2, 'variant mesh=16x1x1: mesh: '
         'data*fsdp*tensor = 16*1*1 = 16, but there are 8 devices; make the product 8 or set one '
         'axis to -1; on CPU, simulate 16 devices by starting the command with '
         'XLA_FLAGS=--xla_force_host_platform_device_count=16.'),
        ([TINY, SWEEP, '--grid=mode=auto,bogus'], 2, "variant mode=bogus: parallelism.mode="
         "'bogus' is unknown; choose one of ['auto', 'manual']."),
        ([TINY, '--workdir=$T/notes.txt', '--grid=mode=auto'], 2, '--workdir=$T/notes.txt is a '
         'file, not a directory; pass a new path or the directory of the sweep to resume.'),
    ],
    'engine.plan': [
        ([TINY], 2, '--topology is required: TPU topology VERSION:SHAPE, e.g. v5p:4x4x8.'),
        ([TINY, '--topology=v9:2x2'], 2, "--topology='v9:2x2' is not a TPU topology; write "
         'VERSION:SHAPE with VERSION one of v4, v5e, v5p, v6e and SHAPE its chips per dimension, '
         'e.g. v5p:4x4x8 (v5p-256), v5e:4x4 (v5e-16), v6e:8x8.'),
        ([TINY, V5P, '--num_slices=0'], 2, '--num_slices=0 must be >= 1.'),
        ([TINY, V5P, '--meshes=2x'], 2, f'--meshes=2x: {MESH_FORMAT}'),
        ([TINY, V5P, '--modes=bogus'], 2,
         "--modes='bogus' is unknown; choose one of ['auto', 'manual']."),
        ([TINY, V5P, '--dcn_gb_per_s=0'], 2, '--dcn_gb_per_s=0 must be a positive number.'),
        ([TINY, V5P, '--host_gb_per_s=-1'], 2, '--host_gb_per_s=-1 must be a positive number.'),
        ([TINY, V5P, '--search', '--fixed=pipeline=2'], 2, "--fixed='pipeline=2' must be "
         'AXIS=SIZE, AXIS one of data, fsdp, tensor, context, stage, expert and SIZE a positive '
         'integer, e.g. --fixed=tensor=1,stage=1.'),
        ([TINY, V5P, '--search', '--meshes=8x1x1'], 2, '--search finds the meshes itself: drop '
         '--meshes, or drop --search.'),
        ([TINY, V5P, '--search', '--top=0'], 2, '--top=0 must be at least 1: the candidates to '
         'compile.'),
        ([TINY, V5P, '--meshes=3x1x1'], 2, 'no candidate can run on v5p:2x2x2; the first, mesh '
         '3x1x1x1x1x1: mesh: data*fsdp*tensor = 3*1*1 = 3, but there are 8 devices; make the '
         'product 8 or set one axis to -1.'),
        ([TINY, V5P, '--out=$T/no_such_dir/plan'], 2, '--out=$T/no_such_dir/plan: '
         '$T/no_such_dir is not a directory; create it, or pass a prefix in one.'),
        ([TINY, V5P, '--config.model.matmul_precision=fp8', '--config.model.matmul_block=16'],
         2, "model.matmul_precision='fp8': TPU v5p has no fp8 matmul units (engine/chips.py); "
         "choose 'int8' or 'default'."),
    ],
    'engine.analysis.bubble': [
        ([], 2, '--config is required: Experiment config file (a mesh with mesh.stage > 1).'),
        ([TINY], 2, "mesh.stage=1: the bubble is a pipeline's; use a mesh with stage > 1 (e.g. "
         ':mesh=2x1x1x1x4).'),
        ([PIPELINE, '--microbatches=0,4'], 2, '--microbatches=0,4: give positive integers joined '
         'by commas, e.g. --microbatches=4,8,12,16.'),
        ([PIPELINE, '--microbatches=4'], 2,
         '--microbatches=[4]: give at least two different counts to fit a line through.'),
        ([PIPELINE, '--modes=bogus'], 2,
         "--modes='bogus' is unknown; choose one of ['auto', 'manual']."),
    ],
    'engine.analysis.compare': [
        ([TINY], 2, '--out is required: Directory for report.md, report.json and the plots.'),
        # --workdir, compare's earlier name for --out, still works.
        ([TINY, '--workdir=$T/report', '--steps=0'], 2,
         '--steps=0 must be >= 1 and --warmup=2 >= 0.'),
        ([TINY, '--out=$T/report', '--atol=-1'], 2, '--atol=-1 must be a positive number '
         '(the largest difference from the reference that agrees).'),
        ([TINY, '--out=$T/notes.txt'], 2, '--out=$T/notes.txt is a file, not a directory; pass '
         'a new path or a directory to write into.'),
        ([TINY, '--out=$T/report', '--modes=bogus'], 2,
         "--modes='bogus' is unknown; choose one of ['auto', 'manual']."),
    ],
    'engine.analysis.show_layout': [
        ([], 2, '--config is required: Experiment config file.'),
        (['--config=experiments/tiny.py:mesh=3x1x1'], 2, 'mesh: data*fsdp*tensor = 3*1*1 = 3, '
         'but there are 8 devices; make the product 8 or set one axis to -1.'),
        ([TINY, '--config.model.embed_dim=66'], 2, 'model.embed_dim=66 is not divisible by '
         'model.num_heads=4; change one of them so that model.num_heads divides '
         'model.embed_dim.'),
    ],
    'engine.analysis.hf_check': [
        ([], 2, '--torch_python is required: A Python with torch and transformers >= 5, e.g. '
         'ENV/bin/python.'),
        (['--torch_python=$T/no_such_python'], 2, '--torch_python=$T/no_such_python: cannot run '
         'it (No such file or directory); pass a Python that has torch and transformers >= 5.'),
        ([HF_CHECK, '--families=gpt9'], 2,
         "--families: 'gpt9' is unknown; choose from llama2,llama3,mistral,qwen2,qwen3,mixtral,"
         'qwen3_moe,deepseek_v3,gemma2,gemma3.'),
        ([HF_CHECK, '--formats=x'], 2, "--formats: 'x' is unknown; choose from v5,legacy."),
        ([HF_CHECK, '--mesh=2x'], 2, f'--mesh=2x: {MESH_FORMAT}'),
    ],
    'engine.analysis.tokenizer_check': [
        ([], 2, '--transformers_python is required: A Python with transformers (and '
         'sentencepiece, protobuf), e.g. ENV/bin/python.'),
        (['--transformers_python=$T/no_such_python'], 2, '--transformers_python=$T/no_such_python: '
         'cannot run it (No such file or directory); pass a Python with transformers, '
         'sentencepiece and protobuf (pip install transformers sentencepiece protobuf).'),
        ([TOKENIZER_CHECK, '--kinds=wordpiece'], 2, "--kinds: 'wordpiece' is unknown; choose from "
         'bpe,bpe_bos,sentencepiece_bpe,sentencepiece_unigram.'),
        ([TOKENIZER_CHECK, '--architectures=GPT2LMHeadModel'], 2, "--architectures: "
         "'GPT2LMHeadModel' is unknown; choose from LlamaForCausalLM,MistralForCausalLM,"
         'Qwen2ForCausalLM,Qwen3ForCausalLM,Gemma2ForCausalLM,Gemma3ForCausalLM,'
         'MixtralForCausalLM,Qwen3MoeForCausalLM,DeepseekV3ForCausalLM.'),
    ],
    'engine.data.prepare': [
        ([], 2, '--input is required: Text, JSON lines or Parquet file, datasets directory, '
         'directory of them, or "embedded"; repeatable.'),
        (['--input=$T/records.jsonl', '--tokenizer=byte', '--out=$T/set'], 2,
         "--input='$T/records.jsonl' has no field 'text' (its records have 'body', 'id'); pass "
         '--text_field=the field that holds the text.'),
        (['--input=$T/chats.jsonl', '--messages_field=messages', '--tokenizer=byte',
          '--out=$T/set'], 2, '--messages_field renders conversations with a chat template, '
         'which --tokenizer=byte has none of; pass --tokenizer=hf --tokenizer_path=the '
         "model's tokenizer.json."),
        (['--input=$T/null_record.jsonl', '--tokenizer=byte', '--out=$T/set'], 2,
         "--input='$T/null_record.jsonl': record 2 has no 'text' (missing or null); fill it in or "
         'drop the record.'),
        (['--input=$T/hello.txt'], 2, '--out is required: Directory to write the shards and '
         'meta.json to.'),
        (['--input=$T/empty.txt', '--tokenizer=byte', '--out=$T/set'], 2, "--input='$T/empty.txt' "
         'is empty: there is no text to tokenize; pass a file or directory with text.'),
        (['--input=$T/empty_dir', '--tokenizer=byte', '--out=$T/set'], 2,
         "--input='$T/empty_dir' holds no files: there is no text to tokenize; pass a file or "
         'directory with text.'),
        (['--input=$T/no_such_file.txt', '--tokenizer=byte', '--out=$T/set'], 2,
         "--input='$T/no_such_file.txt' is neither a file, a directory, nor \"embedded\"; pass a "
         'text file or a directory of them.'),
        (['--input=$T/hello.txt', '--tokenizer=hf', '--out=$T/set'], 2, '--tokenizer=hf reads '
         '--tokenizer_path, but none is given; pass --tokenizer_path=tokenizer.json (python -m '
         'engine.data.train_tokenizer makes one from any text).'),
        (['--input=$T/hello.txt', '--tokenizer=sentencepiece', '--tokenizer_path=$T/no.model',
          '--out=$T/set'], 2, "--tokenizer=sentencepiece reads --tokenizer_path, but "
         "'$T/no.model' is not a file; pass --tokenizer_path=a SentencePiece .model file."),
        (['--input=$T/hello.txt', '--tokenizer=char', '--out=$T/set'], 2,
         '--tokenizer=char: value should be one of <byte|hf|sentencepiece>.'),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/notes.txt'], 2,
         "--out='$T/notes.txt' is a file; pass a new directory for the shard set."),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/notes.txt/set'], 2,
         "--out='$T/notes.txt/set' lies under '$T/notes.txt', which is a file; pass a new "
         'directory for the shard set.'),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/other'], 2, "--out='$T/other' "
         "holds other files ('notes.txt', ...); pass a new or empty directory for the shard set."),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/old_set'], 2,
         "--out='$T/old_set' already holds a shard set (or part of one); pass --overwrite to "
         'replace it, or another --out.'),
        (['--input=$T/latin1.txt', '--tokenizer=byte', '--out=$T/set'], 2,
         f"--input='$T/latin1.txt' {UTF8}"),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/set', '--record_tokens=0'], 2,
         '--record_tokens=0 must be >= 1.'),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/set', '--records_per_shard=0'],
         2, '--records_per_shard=0 must be >= 1.'),
        (['--input=$T/hello.txt', '--tokenizer=byte', '--out=$T/set', '--processes=-1'], 2,
         '--processes=-1 must be >= 0 (0: one per core).'),
    ],
    'engine.data.train_tokenizer': [
        ([], 2, '--out is required: Where to write the tokenizer.json.'),
        (['--input=$T/hello.txt', '--vocab_size=300', '--out=$T/bpe.json'], 2,
         '--vocab_size=300: the input yields only 266 tokens; pass more text or a --vocab_size '
         'of at most 266.'),
        (['--input=$T/empty.txt', '--out=$T/bpe.json'], 2, "--input='$T/empty.txt' is empty: "
         'there is no text to tokenize; pass a file or directory with text.'),
        (['--input=$T/empty_dir', '--out=$T/bpe.json'], 2, "--input='$T/empty_dir' holds no "
         'files: there is no text to tokenize; pass a file or directory with text.'),
        (['--input=$T/hello.txt', '--vocab_size=260', '--out=$T/other'], 2, "--out='$T/other' "
         'is a directory; pass a file path, e.g. --out=$T/other/tokenizer.json.'),
        (['--input=$T/hello.txt', '--vocab_size=260', '--out=$T/no_such_dir/bpe.json'], 2,
         "--out='$T/no_such_dir/bpe.json': $T/no_such_dir is not a directory; create it or pass "
         'another path.'),
        (['--input=$T/hello.txt', '--vocab_size=260', '--out=$T/notes.txt'], 2,
         "--out='$T/notes.txt' already exists (shard sets prepared with it would no longer match "
         'it); pass --overwrite to replace it, or another --out.'),
        (['--input=$T/hello.txt', '--vocab_size=many', '--out=$T/bpe.json'], 2,
         '--vocab_size=many is not an integer; give one, e.g. --vocab_size=4096.'),
    ],
}

# The launchers' rows, after the engine's commands (the docs tables keep this order).
COMMAND_ROWS.update(LAUNCHER_ROWS)
