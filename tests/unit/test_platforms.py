"""engine.runtime.platforms: JAX_PLATFORMS chosen before JAX starts, so that a CPU machine with libtpu
installed starts no TPU backend (and prints none of libtpu's start-up errors)."""

import os
import subprocess
import sys

import pytest

from engine.runtime import platforms

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What libtpu and JAX printed on a 2-core CPU machine with the tpu extra and JAX_PLATFORMS unset.
TPU_NOISE = ('Failed to find host bounds', 'TPU_ACCELERATOR_TYPE', 'Logging before InitGoogle',
             'unexpected worker hostname', 'TPU_WORKER_HOSTNAMES', 'libtpu',
             "Unable to initialize backend 'tpu'", 'TPU initialization failed')


@pytest.mark.parametrize('jax_platforms', ['cpu', 'tpu', 'cuda,cpu', ''])
def test_the_users_value_is_kept(jax_platforms):
  # Even an empty one: JAX's own "choose an available backend".
  for tpu_visible in (True, False, None):
    assert platforms.choose(jax_platforms, tpu_visible, []) is None
    assert platforms.choose(jax_platforms, tpu_visible, ['xla_cuda12']) is None


def test_a_visible_tpu_or_an_unknown_one_is_left_to_jax():
  assert platforms.choose(None, True, []) is None
  assert platforms.choose(None, None, []) is None


def test_no_tpu_and_no_plugin_is_cpu():
  assert platforms.choose(None, False, []) == 'cpu'


@pytest.mark.parametrize('plugins', [['xla_cuda12'], ['xla_rocm7'], ['metal_plugin']])
def test_an_accelerator_plugin_is_left_to_jax(plugins):
  # Listing 'cuda,cpu' would make a CUDA plugin that cannot start fail loudly, not fall back.
  assert platforms.choose(None, False, plugins) is None


def test_plugins_are_found_where_jax_finds_them(tmp_path, monkeypatch):
  (tmp_path / 'jax_plugins' / 'xla_fake_gpu').mkdir(parents=True)
  (tmp_path / 'jax_plugins' / 'xla_fake_gpu' / '__init__.py').write_text('')
  monkeypatch.syspath_prepend(str(tmp_path))  # The namespace package, as jax-cuda12-plugin has.
  monkeypatch.setenv('PJRT_NAMES_AND_LIBRARY_PATHS', f'other{os.pathsep}/lib/other.so')
  assert {'xla_fake_gpu', 'other'} <= set(platforms.installed_plugins())


def test_select_leaves_a_set_value_and_a_started_backend_alone(monkeypatch):
  monkeypatch.setenv('JAX_PLATFORMS', '')
  assert platforms.select() is None and os.environ['JAX_PLATFORMS'] == ''
  import jax
  jax.devices()  # This process's backend has started (conftest: 'cpu').
  monkeypatch.delenv('JAX_PLATFORMS')
  assert platforms.select() is None and 'JAX_PLATFORMS' not in os.environ


def _env_without_jax_platforms(devices=1):
  env = dict(os.environ, XLA_FLAGS=(
      os.environ['XLA_FLAGS'] + f' --xla_force_host_platform_device_count={devices}'))
  env.pop('JAX_PLATFORMS', None)  # conftest sets it for this process; the command must not see it.
  return env


def require_cpu_only():
  # The suite runs on CPU machines (README); on one with a TPU or an accelerator plugin these
  # two tests would prove nothing, so they fail rather than pass or skip.
  assert platforms.choose(None, platforms.tpu_visible(), platforms.installed_plugins()) == 'cpu', (
      'this machine has a TPU or an accelerator plugin; run the suite on a CPU machine')


def test_import_engine_decides_without_importing_jax():
  code = ('import os, sys, engine; from engine.runtime import platforms; '
          'print("jax" in sys.modules, platforms.tpu_visible(), os.environ.get("JAX_PLATFORMS"))')
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=_env_without_jax_platforms(),
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  jax_imported, tpu_visible, value = proc.stdout.split()
  assert jax_imported == 'False'  # `import jax` reads JAX_PLATFORMS: the choice came first.
  assert tpu_visible in ('True', 'False')  # JAX's detection loaded, not "unknown".
  expected = platforms.choose(None, tpu_visible == 'True', platforms.installed_plugins())
  assert value == str(expected)


def test_jax_imported_before_engine_gets_the_choice_through_its_config():
  require_cpu_only()
  code = 'import jax, engine; print(jax.config.jax_platforms)'
  proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=_env_without_jax_platforms(),
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == 'cpu'


# A real run without JAX_PLATFORMS and without TPU noise: tests/commands/test_cli.py
# (test_main_runs_an_experiment_with_overrides).
