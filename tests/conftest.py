"""Every test process gets 8 simulated CPU devices, requested before JAX starts its backend.

It also asks XLA for its cheapest CPU code generation: the suite compiles over two thousand
small programs and runs each a few times, so compiling, not running, is most of its time. LLVM
at -O0 (its optimisation of the generated code took about two thirds of each compile), the
elemental emitters for fusions instead of the MLIR fusion emitters (which took most of the rest:
a tiny Llama's step on 2x2x2 compiled in 2.1 s with them, 0.8 s without), and the generated
code in one piece (split, it is compiled on several threads that the two test workers already
keep busy). XLA's HLO optimisations, which decide the collectives, the fusions and the memory
the tests check, run as usual; subprocesses the tests start inherit the flags (a later
--xla_force_host_platform_device_count overrides the count).

Compiled programs are shared through JAX's persistent compilation cache, in a directory of this
session's own (shared by the xdist workers and every subprocess the tests start, removed at the
end; a JAX_COMPILATION_CACHE_DIR already set is used instead, and kept): the commands the tests run
as subprocesses (a run, its resume, its evaluation) compile the same programs again, and about a
fifth of their time went to those compiles (tests/runs: 80 s to 63 s). Tests that compile each
program once (the parity tests, the TPU planning compiles) go without it, by the fixture
`without_persistent_cache`: keying and writing every program cost the parity tests 5-6 % of
their time, the planning tests (large TPU executables) 17 %, with nothing read back.

The allocator settings that `import engine` applies for faster CPU steps
(engine/runtime/allocator.py) are off: they made the suite's many multi-threaded compiles 15-20 %
slower, and tests measure numbers, not step time.
"""

import os
import shutil
import tempfile

# Made by the first process of the session (xdist's controller, or pytest alone); the workers
# and subprocesses inherit the variable. The maker removes it at the end.
_MADE_CACHE = 'JAX_COMPILATION_CACHE_DIR' not in os.environ
if _MADE_CACHE:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='engine-tests-xla-cache-')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8'
                           ' --xla_backend_optimization_level=0'
                           ' --xla_cpu_use_fusion_emitters=false'
                           ' --xla_cpu_parallel_codegen_split_count=1').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('ENGINE_TUNE_MALLOC', '0')

import jax  # noqa: E402  (must follow the flags)
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope='session', autouse=True)
def eight_devices():
  # Fail, never skip: a mesh test on fewer devices would prove nothing.
  assert jax.device_count() == NUM_DEVICES, (
      f'tests need {NUM_DEVICES} CPU devices, got {jax.device_count()}; XLA_FLAGS was set too '
      'late (JAX initialised before tests/conftest.py ran).')


@pytest.fixture(scope='module')
def without_persistent_cache():
  """The module's tests compile without the persistent compilation cache."""
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()  # Whether the cache is used is decided once, until reset.
  yield
  jax.config.update('jax_enable_compilation_cache', True)
  compilation_cache.reset_cache()


def pytest_sessionfinish(session):
  if _MADE_CACHE:
    shutil.rmtree(os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
