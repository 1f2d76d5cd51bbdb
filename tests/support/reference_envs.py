"""The virtualenv the comparisons against outside implementations run in: CPU torch,
transformers, peft, lm-eval (and what they need), at the pinned versions below, built once into
a cache directory and reused. The suite never imports them: each comparison runs a child process
with this environment's Python (tests/README.md lists them).

  python -m tests.support.reference_envs     # README's test command runs this before pytest

The cache is $ENGINE_REFERENCE_CACHE, else ~/.cache/engine-references/; the environment is named
by a digest of its pins, so a change of pins builds a new one beside the old. The engine's own
packages (jax, the engine installed from this checkout) are visible in it after its own, through
a .pth file naming the builder's site-packages: lm-eval's comparison runs `python -m
engine.lm_eval` there, and nothing is installed twice. A test whose environment is missing or
broken fails with the reason and the command that builds it; it never skips.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import sysconfig
import time

# What the comparisons were checked with (BUILD.md, "Tested versions"). torch's CPU build: on
# machines that keep its wheel locally pip takes that file; elsewhere pip downloads torch's
# default build, which runs on the CPU too.
PINS = ('torch==2.13.0', 'transformers==5.25.0', 'peft==0.21.2', 'lm_eval==0.4.13',
        'datasets==5.2.0', 'sentencepiece==0.2.3', 'protobuf==6.33.6')
READY = 'ready'  # Written last: an environment without it was interrupted and is built again.


def cache_root() -> pathlib.Path:
  return pathlib.Path(os.environ.get('ENGINE_REFERENCE_CACHE') or
                      pathlib.Path.home() / '.cache' / 'engine-references')


def environment() -> pathlib.Path:
  """Where the environment of these pins lives (built or not)."""
  digest = hashlib.sha256('\n'.join(PINS).encode()).hexdigest()[:12]
  return cache_root() / f'py{sys.version_info.major}{sys.version_info.minor}-{digest}'


def python() -> str:
  """The environment's Python, built and ready, seeing this process's engine environment;
  RuntimeError saying why and how otherwise."""
  env = environment()
  if not (env / READY).exists():
    raise RuntimeError(
        f'the reference environment {env} is not built (torch, transformers, peft, lm-eval at '
        f'{", ".join(PINS)}): run `python -m tests.support.reference_envs` (README\'s test '
        'command does) and see its output for why a build failed.')
  _see_this_engine(env)
  return str(env / 'bin' / 'python')


def _see_this_engine(env: pathlib.Path) -> None:
  """The engine's environment (this process's site-packages, where this checkout is installed)
  after the reference environment's own packages, its .pth files processed: written at every
  use, so a cached environment follows the virtualenv that uses it."""
  own = next(env.glob('lib/python*/site-packages'))
  engines = sysconfig.get_paths()['purelib']
  (own / 'engine_environment.pth').write_text(f'import site; site.addsitedir({engines!r})\n')


def _run(args: list[str]) -> None:
  print('+', ' '.join(args), flush=True)
  subprocess.run(args, check=True)


def build() -> pathlib.Path:
  """Builds the environment unless it is ready; returns its path."""
  env = environment()
  if (env / READY).exists():
    _see_this_engine(env)
    print(f'The reference environment is ready: {env}')
    return env
  start = time.perf_counter()
  _run([sys.executable, '-m', 'venv', '--clear', str(env)])
  pip = [str(env / 'bin' / 'python'), '-m', 'pip', 'install', '--quiet',
         '--disable-pip-version-check']
  _run(pip + list(PINS))
  _see_this_engine(env)
  _run([str(env / 'bin' / 'python'), '-c',
        'import torch, transformers, peft, lm_eval, sentencepiece, engine; '
        'print("torch", torch.__version__, "transformers", transformers.__version__)'])
  (env / READY).write_text('\n'.join(PINS) + '\n')
  print(f'Built the reference environment in {time.perf_counter() - start:.0f} s: {env}')
  return env


if __name__ == '__main__':
  try:
    build()
  except subprocess.CalledProcessError as error:
    sys.exit(f'error: building the reference environment failed ({error}); the comparisons '
             'against transformers, peft and lm-eval will fail until it is built.')
