"""engine.distributed.startup.fail_run in a multi-process run, with the coordinator's key-value
store faked: the first failure reported stands. A process that finds its own reason to fail only
after another has reported (stopped and woken, its wait now too long) says the other's error,
as every other process does, rather than a second error of its own."""

import threading

import pytest

from engine.distributed import startup

FIRST = 'the run has made no progress for 4 s (train.hang_timeout_s) since it dispatched step 12'


class Store:
  """The failure key, holding `report` (None: nothing reported yet)."""

  def __init__(self, report: str | None):
    self.report, self.written = report, []

  def key_value_try_get(self, key):
    assert key == startup._FAILURE_KEY
    if self.report is None:
      raise RuntimeError('NOT_FOUND')
    return self.report

  def key_value_set(self, key, value):
    self.written.append((key, value))


@pytest.fixture
def process_1_of_2(monkeypatch):
  monkeypatch.setattr(startup, '_ACTIVE', startup.DistributedOptions())
  monkeypatch.setattr(startup, '_REPORTED', threading.Lock())
  monkeypatch.setattr(startup.jax, 'process_index', lambda: 1)
  monkeypatch.setattr(startup.jax, 'process_count', lambda: 2)

  def leave(code):  # The real one exits the process.
    raise SystemExit(code)

  monkeypatch.setattr(startup, '_leave', leave)

  def with_store(report):
    store = Store(report)
    monkeypatch.setattr(startup, 'client', lambda: store)
    return store

  return with_store


def test_a_failure_after_another_process_reported_names_that_one(process_1_of_2, capsys):
  store = process_1_of_2(f'0\n1\n{FIRST}')
  with pytest.raises(SystemExit) as leaving:
    startup.fail_run('the run has made no progress ...: process 0 is behind', 1)
  assert leaving.value.code == 1
  assert capsys.readouterr().err == (
      f'error: process 0 of 2 failed, so process 1 stops too: {FIRST}\n')
  assert store.written == []  # The first report stands.


def test_the_first_failure_is_reported_in_its_own_words(process_1_of_2, capsys):
  store = process_1_of_2(None)
  with pytest.raises(SystemExit):
    startup.fail_run('data.shards is unreadable', 2)
  assert capsys.readouterr().err == 'error: data.shards is unreadable\n'
  assert store.written == [(startup._FAILURE_KEY, '1\n2\ndata.shards is unreadable')]


def test_a_detected_cluster_without_its_metadata_runs_as_one_process(monkeypatch):
  """A TPU VM's devices without its metadata server (a lone chip kept off the network): JAX's
  cluster detection finds a TPU VM, its initialisation cannot read the cluster's settings, and
  the command goes on as one process instead of ending in a traceback. Asked for several
  processes, it still fails."""
  def unreachable(**_):
    raise ConnectionError('metadata.google.internal: Name or service not known')
  monkeypatch.setattr(startup, 'detected_cluster', lambda: 'gce_tpu')
  monkeypatch.setattr(startup.jax.distributed, 'initialize', unreachable)
  startup.initialize(startup.DistributedOptions())
  assert startup._ACTIVE is None  # pylint: disable=protected-access
  with pytest.raises(ConnectionError):
    startup.initialize(startup.DistributedOptions(num_processes=2))
