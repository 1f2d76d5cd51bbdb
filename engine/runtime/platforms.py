"""Which JAX platforms to start, chosen before any backend starts (engine/__init__.py calls
`select()` when `engine` is imported).

With libtpu installed (the `tpu` extra, which `engine.plan` and the tests need) and JAX_PLATFORMS
unset, JAX tries the TPU backend first on every machine. On a CPU machine libtpu then prints its
start-up errors ("Failed to find host bounds for accelerator type", "Logging before
InitGoogle()", "unexpected worker hostname", "Unable to initialize backend 'tpu': ... TPU
initialization failed: No jellyfish device found") before JAX falls back to the CPU, and backend
start-up takes many times longer (BUILD.md). Where no TPU chip is visible and no other
accelerator plugin is installed, `select()` sets JAX_PLATFORMS=cpu, the value BUILD.md used to
tell users to set. Gathering the facts is one scan of the installed packages' entry points (as
JAX's plugin discovery does) and of the PCI bus, at import.

What the choice rests on (`choose`, a pure function, is the rule; `select` gathers the facts):
  - an explicit JAX_PLATFORMS, even an empty one (JAX's "choose for me"), is the user's: kept;
  - TPU chips visible (JAX's own PCI scan, the one its Cloud TPU set-up uses, or TPU device
    files), or JAX_FORCE_TPU_INIT set: left to JAX, which picks the TPU;
  - TPU visibility unknown (JAX's scan could not be loaded): left to JAX, noisy but right;
  - a PJRT plugin installed (CUDA, ROCm or any other, from the `jax_plugins` namespace package,
    its entry points or PJRT_NAMES_AND_LIBRARY_PATHS): left to JAX. Excluding only the TPU would
    need the list of the other platforms, and JAX fails loudly on any platform in an explicit
    list that does not start (a CUDA plugin on a machine whose driver it cannot use, a ROCm
    plugin without an AMD GPU), where on its own it falls back quietly, and an explicit list
    also reorders the platforms' priorities. A GPU machine with libtpu installed keeps the TPU
    noise; it keeps its GPU, which matters more;
  - otherwise: 'cpu', the only platform that could start.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Sequence

ENV = 'JAX_PLATFORMS'


def choose(jax_platforms: str | None, tpu_visible: bool | None,
           plugins: Sequence[str]) -> str | None:
  """The JAX_PLATFORMS value to set, or None to leave JAX alone. `jax_platforms`: the variable's
  value, None where unset; `tpu_visible`: None where unknown; `plugins`: the installed PJRT
  plugins' names (the TPU's, built into JAX, is not one)."""
  if jax_platforms is not None or tpu_visible is not False or plugins:
    return None
  return 'cpu'


def _jax_hardware_utils():
  """JAX's hardware detection (jax._src.hardware_utils: standard library only), without importing
  JAX when it is not yet imported: `import jax` reads JAX_PLATFORMS, so it must come after."""
  if 'jax' in sys.modules:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    return hardware_utils
  spec = importlib.util.find_spec('jax')  # Locates the package; runs none of it.
  path = os.path.join(spec.submodule_search_locations[0], '_src', 'hardware_utils.py')
  module_spec = importlib.util.spec_from_file_location('_engine_jax_hardware_utils', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module


def tpu_visible() -> bool | None:
  """Whether this machine shows a TPU the way JAX looks for one; None where it cannot tell."""
  if 'JAX_FORCE_TPU_INIT' in os.environ:  # JAX's switch to start the TPU without seeing chips.
    return True
  # The device files libtpu opens (v2-v4: /dev/accel*, v5 and later: /dev/vfio), for containers
  # that do not show the PCI bus.
  if glob.glob('/dev/accel*') or os.path.exists('/dev/vfio'):
    return True
  try:
    num_chips, _ = _jax_hardware_utils().num_available_tpu_chips_and_device_id()
  except Exception:  # pylint: disable=broad-except
    return None  # JAX moved or changed it: do not guess.
  return num_chips > 0


def installed_plugins() -> list[str]:
  """The PJRT plugins JAX would discover (xla_bridge.discover_pjrt_plugins and
  PJRT_NAMES_AND_LIBRARY_PATHS), by name."""
  names = []
  spec = importlib.util.find_spec('jax_plugins')
  if spec is not None and spec.submodule_search_locations:
    names += [m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations))]
  from importlib.metadata import entry_points  # pylint: disable=g-import-not-at-top
  names += [entry_point.name for entry_point in entry_points(group='jax_plugins')]
  names += [p.split(os.pathsep)[0] for p in os.environ.get('PJRT_NAMES_AND_LIBRARY_PATHS', '')
            .split(',') if p]
  return names


def select() -> str | None:
  """Sets JAX_PLATFORMS to `choose`'s value where it is unset and no JAX backend has started;
  returns the value set, or None where it left JAX alone."""
  if ENV in os.environ:
    return None
  try:
    jax = sys.modules.get('jax')
    if jax is not None:  # Imported before `engine`: its configuration has read the environment.
      from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
      if xla_bridge.backends_are_initialized() or jax.config.jax_platforms is not None:
        return None
    value = choose(None, tpu_visible(), installed_plugins())
    if value is not None:
      os.environ[ENV] = value  # Read by `import jax`; subprocesses inherit it.
      if jax is not None:
        jax.config.update('jax_platforms', value)
    return value
  except Exception:  # pylint: disable=broad-except
    return None  # Importing `engine` must not fail over this: JAX chooses, as it would anyway.
