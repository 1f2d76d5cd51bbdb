"""Every parity test compiles each layout's program once: without the persistent compilation
cache (tests/conftest.py says why)."""

import pytest


@pytest.fixture(scope='module', autouse=True)
def compile_each_program_once(without_persistent_cache):
  del without_persistent_cache
