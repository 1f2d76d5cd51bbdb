"""The engine's Hugging Face Llama-family support checked against transformers itself.

  python -m engine.analysis.hf_check --torch_python=/path/to/python-with-torch \
      [--families=llama2,llama3,mistral,qwen2,qwen3,mixtral,qwen3_moe,deepseek_v3,gemma2,gemma3] \
      [--formats=v5,legacy] [--modes=auto,manual] [--mesh=2x2x2] [--out=/tmp/hf_check] \
      [--dir=KEEP_FILES_HERE]

For every family and config format, a child process run by --torch_python (a Python with torch
and transformers >= 5; engine/analysis/references/hf_reference.py, so this process never imports
torch) builds a tiny random model of the family with transformers, saves it with save_pretrained (in
transformers 5's `rope_parameters` config format, "v5", or rewritten into the older top-level
`rope_theta` / `rope_scaling` one, "legacy"), and writes transformers' logits on fixed token ids
(the models: hf_reference.py's docstring; Llama 3 rotary, Qwen2 biases, Qwen3 q/k norms, head_dim
and a tied head, Mixtral's and Qwen3-MoE's experts (the engine's dropless dispatch), DeepSeek-V3's
latent attention and routing, Gemma 2's soft caps and Gemma 3's rotary by layer type, every norm
and bias random). Then, in each mode, this process:

  1. loads the directory as `train.init_from=hf:DIR` does (engine.assemble,
     engine.hf.load.load_params) on a DATAxFSDPxTENSOR mesh (default 2x2x2: 8 devices; run
     directly, this command asks XLA for 8 CPU devices itself when XLA_FLAGS does not say);
  2. compares, through each mode's own compiled code: auto, the logits of the auto forward pass
     (as engine.evaluate computes them) against transformers'; both modes, the eval step's mean
     next-token loss, and the loss of one train step, against the cross-entropy of transformers'
     logits (computed here in float64);
  3. takes that one optimizer step, exports the trained parameters with engine.hf.save.save, has
     transformers load the export (AutoModelForCausalLM.from_pretrained) and compute its
     logits, and compares them with the engine's logits of the trained parameters (the auto
     forward pass, for both modes' steps) and the mode's eval loss with their cross-entropy;
     whatever transformers says while loading (its logger's warnings, Python warnings) is
     recorded.

Prints a Markdown table (family | config format | mode | logits | loss | export | load
warnings | verdict) and, with --out, writes OUT.md and OUT.json. A row PASSes when every
difference is float32 noise (the tolerances in engine_side.py) and transformers loaded the export
without a warning: a missing or unexpected tensor, or a config key transformers does not read the
same way, is what this check is for. A family the engine refuses (a ConfigError: a key it does
not compute) is reported as `refused: <why>`, not failed. Exit status 1 if any row FAILs or errs.

This module is the command (its flags); checker.py runs the child process and every check
and writes the report; engine_side.py is the engine's side of each comparison (steps 1 to 3, the
tolerances and the verdict).

tests/unit/test_hf_check.py runs both without torch, a NumPy Llama standing in for transformers.
"""

from __future__ import annotations

import os
import sys

if __name__ == '__main__' and 'jax' not in sys.modules and (
    'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', '')):
  # Before JAX starts: the default 2x2x2 mesh needs 8 devices; on a CPU, simulated ones.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

# pylint: disable=wrong-import-position
import json

from absl import flags, logging

from engine import config as config_lib
from engine import parallel
from engine.analysis.hf_check.checker import FAMILIES, FORMATS, check_all, chosen
from engine.analysis.hf_check.engine_side import LOGITS_RTOL, LOSS_RTOL
from engine.cli.command_line import run_command

_TORCH_PYTHON = flags.DEFINE_string('torch_python', None, 'A Python with torch and '
                                    'transformers >= 5, e.g. ENV/bin/python.')
_FAMILIES = flags.DEFINE_list('families', list(FAMILIES), 'Model families to check.')
_FORMATS = flags.DEFINE_list('formats', list(FORMATS), 'config.json formats: v5 '
                             '(rope_parameters), legacy (rope_theta, rope_scaling).')
_MODES = flags.DEFINE_list('modes', ['auto', 'manual'], 'Parallelism modes.')
_MESH = flags.DEFINE_string('mesh', '2x2x2', f'Mesh {config_lib.MESH_FORMAT}.')
_OUT = flags.DEFINE_string('out', None, 'Write OUT.md and OUT.json.')
_KEEP = flags.DEFINE_string('dir', None, 'Keep the checkpoints, logits and exports here '
                            '(default: a temporary directory, removed at the end).')


def main(argv):
  del argv
  rows, report, versions, made = check_all(
      _TORCH_PYTHON.value, chosen(_FAMILIES.value, FAMILIES, '--families'),
      chosen(_FORMATS.value, FORMATS, '--formats'),
      chosen(_MODES.value, tuple(sorted(parallel.STEP_BUILDERS)), '--modes'), _MESH.value,
      _KEEP.value)
  print(report)
  if _OUT.value:
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value + '.md', 'w') as f:
      f.write(report + '\n')
    with open(_OUT.value + '.json', 'w') as f:
      json.dump({'title': report.splitlines()[0][3:], 'versions': versions, 'rows': rows,
                 'checkpoints': made,
                 'tolerance': {'logits_rtol': LOGITS_RTOL, 'loss_rtol': LOSS_RTOL}}, f,
                indent=1)
    logging.info('Wrote %s.md and %s.json', _OUT.value, _OUT.value)
  if any(row['verdict'] in ('FAIL', 'ERROR') for row in rows):
    sys.exit(1)


if __name__ == '__main__':
  run_command(main, 'engine.analysis.hf_check', required=('torch_python',))
