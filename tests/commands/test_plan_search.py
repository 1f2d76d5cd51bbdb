"""engine.plan --search (engine/plan/search.py): every candidate estimated, the fastest that fit
compiled for a TPU topology (libtpu's compiler, on CPU), and an interrupted search resumed."""

import math

import pytest

from engine import config as config_lib
from engine.assemble import VOCABULARY, assemble
from engine.errors import ConfigError
from engine.plan import planner, search
from engine.plan.report import search_markdown
from tests.commands import test_plan

pytestmark = pytest.mark.usefixtures('without_persistent_cache')  # Each compiled once.

TOPOLOGY = 'v5p:2x2x1'  # 4 chips: few meshes, quick compiles.


def _config():
  """test_plan's model at width 512: no mesh here splits a dimension more than 4 ways."""
  return test_plan._config(width=512)


def test_the_meshes_are_every_product_of_the_devices_with_the_fixed_axes_held():
  found = search.meshes(4, {'stage': 1, 'expert': 1})
  assert all(math.prod(m.values()) == 4 and m['stage'] == m['expert'] == 1 for m in found)
  # 4 = 2^2 over data, fsdp, tensor, context: 10 ways to place the two factors.
  assert len(found) == len({tuple(m.values()) for m in found}) == 10


def test_the_quick_bounds_keep_every_mesh_the_engine_accepts():
  """`_may_be_accepted` runs before assembling each mesh: it may only drop meshes the engine
  refuses (here a batch of 2 rows, 16 devices and a 4-expert model)."""
  config = _config()
  config.data.global_batch_size, config.model.num_experts = 2, 4
  config.model.name, config.model.moe_mlp_dim = 'llama', 32
  devices = planner.topology_devices('v5p:2x2x4')
  dropped = [m for m in search.meshes(len(devices), {})
             if not search._may_be_accepted(config, m)]
  assert dropped  # The bounds do drop some here.
  for mesh in dropped:
    with pytest.raises(ConfigError):
      assemble(config_lib.with_values(config, {f'mesh.{a}': n for a, n in mesh.items()}),
               devices, reads=VOCABULARY)


def test_zero1_is_estimated_per_mode():
  """Manual ZeRO-1 gathers the updated blocks into new parameters while the step's own are
  alive: a second copy of them; auto mode's XLA reduce-scatters gradients as they are made: half
  of them (the searches' compiles: docs/benchmarks.md)."""
  devices = planner.topology_devices(TOPOLOGY)
  hardware = planner.Hardware.of(devices)
  by_sharding = {}
  for sharding in ('params', 'zero1'):
    config = config_lib.with_values(_config(), {
        'mesh.data': 4, 'mesh.fsdp': 1, 'mesh.tensor': 1,
        'parallelism.optimizer_sharding': sharding})
    run = assemble(config, devices, reads=VOCABULARY)
    estimate = search.estimate(run, hardware)
    by_sharding[sharding] = {mode: memory - estimate['state_bytes']  # Beside the train state.
                             for mode, memory in estimate['memory_bytes_by_mode'].items()}
  params = sum(p.bytes_per_device for p in run.setup.parameters())
  zero1, replicated = by_sharding['zero1'], by_sharding['params']
  assert zero1['manual'] - replicated['manual'] == pytest.approx(params)
  assert replicated['auto'] - zero1['auto'] == pytest.approx(params / 2)
  assert replicated['manual'] == replicated['auto']


def test_an_offloaded_optimizer_state_is_estimated_on_the_host_link():
  """parallelism.offload_optimizer: the moments leave the chip's memory estimate, and their trip
  to the chip and back is timed at the host link's bandwidth."""
  devices = planner.topology_devices(TOPOLOGY)
  hardware = planner.Hardware.of(devices, host_gb_per_s=10)
  estimates = {}
  for offload in (False, True):
    config = config_lib.with_values(_config(), {
        'mesh.data': 4, 'mesh.fsdp': 1, 'mesh.tensor': 1,
        'parallelism.offload_optimizer': offload})
    run = assemble(config, devices, reads=VOCABULARY)
    estimates[offload] = search.estimate(run, hardware)
  params = sum(p.bytes_per_device for p in run.setup.parameters())
  moments = estimates[False]['state_bytes'] - params
  assert estimates[True]['state_bytes'] == params and moments == 2 * params
  for mode in ('auto', 'manual'):
    assert (estimates[False]['memory_bytes_by_mode'][mode]
            - estimates[True]['memory_bytes_by_mode'][mode]) == moments
  assert estimates[True]['serial_s'] - estimates[False]['serial_s'] == pytest.approx(
      2 * moments / 10e9)


@pytest.fixture(scope='module')
def searched(tmp_path_factory):
  out = str(tmp_path_factory.mktemp('search') / 'gpt')
  first = search.search(_config(), TOPOLOGY, ['auto'], {'context': 1}, 1, out)
  return out, first


@pytest.mark.slow
def test_the_fastest_estimates_that_fit_are_compiled(searched):
  _, result = searched
  estimates = result['estimates']
  assert estimates and all(e['mesh']['context'] == 1 for e in estimates)
  fitting = sorted((e for e in estimates
                    if e['memory_bytes_by_mode']['auto'] <= 0.9 * result['hbm_bytes_per_device']),
                   key=lambda e: e['serial_s'])
  [row] = result['candidates']
  assert row['key'] == fitting[0]['key'] and row['status'] == 'fits' and row['rank'] == 1
  # The train state is laid out, not guessed: the compiled step's arguments hold it.
  assert row['estimate']['state_bytes'] == pytest.approx(
      row['memory']['argument_size_in_bytes'], rel=0.01)
  report = search_markdown(result, 'experiments/tiny.py')
  assert '--config.model.remat=' in report and f'--config.mesh.data={row["mesh_shape"]["data"]}' \
      in report


@pytest.mark.slow
def test_a_search_resumes_from_its_json(searched, monkeypatch):
  """Rerun with --top=2: the first candidate is read back, only the second compiles."""
  out, first = searched
  compiled = []
  original = planner.plan_candidate

  def counted(config, mode, *args, **kwargs):
    compiled.append((dict(config.mesh), config.model.remat))
    return original(config, mode, *args, **kwargs)

  monkeypatch.setattr(planner, 'plan_candidate', counted)
  again = search.search(_config(), TOPOLOGY, ['auto'], {'context': 1}, 2, out)
  assert len(compiled) == 1 and len(again['candidates']) == 2
  assert again['candidates'][0]['key'] == first['candidates'][0]['key']
  assert sorted(r['rank'] for r in again['candidates']) == [1, 2]


@pytest.mark.slow
def test_another_search_in_the_same_json_is_refused(searched):
  out, _ = searched
  with pytest.raises(ConfigError, match='holds another search'):
    search.search(_config(), TOPOLOGY, ['auto'], {'context': 1, 'stage': 1}, 1, out)


@pytest.fixture(scope='module')
def two_slices():
  """Manual data 4 x fsdp 2 over two slices: the search tries both splits of the slices."""
  fixed = {'data': 4, 'fsdp': 2, 'tensor': 1, 'context': 1, 'stage': 1, 'expert': 1}
  return search.search(_config(), TOPOLOGY, ['manual'], fixed, 1, None, num_slices=2)


@pytest.mark.slow
def test_two_slices_are_searched_over_each_split_and_their_traffic_is_the_theorys(two_slices):
  """Each mesh is tried with the slices across data and across fsdp; the compiled step's
  gradient all-reduce over data runs as the theory splits it (engine/analysis/slices.py): a
  reduce-scatter in the slice, the slice's share all-reduced between slices (XLA:TPU's
  data-centre network sends, the `dcn` rows), an all-gather in the slice; and the estimate's
  time between slices is the compiled step's."""
  splits = {(e['lever']['mesh.dcn_data'], e['lever']['mesh.dcn_fsdp'])
            for e in two_slices['estimates']}
  assert splits == {(2, 1), (1, 2)} and two_slices['devices'] == 8
  [row] = two_slices['candidates']
  assert row['status'] == 'fits' and row['config']['mesh']['dcn_data'] == 2
  assert row['estimate']['lever']['parallelism.optimizer_sharding'] == 'params'
  table = {(r['kind'], r['axes']): r for r in row['communication']}
  for key in (('all-reduce', 'dcn'), ('reduce-scatter', 'data'), ('all-gather', 'data')):
    assert table[key]['manual']['ratio'] == pytest.approx(1, abs=0.01), key
  # Between slices: the data all-reduce's share (every gradient over the 2 devices in a slice).
  gradients = sum(p.bytes_per_device for p in assemble(
      config_lib.with_values(_config(), {'mesh.data': 4, 'mesh.fsdp': 2,
                                         'mesh.dcn_data': 2}), planner.topology_devices(
          TOPOLOGY, 2), reads=VOCABULARY).setup.parameters())
  assert table[('all-reduce', 'dcn')]['theory_bytes'] == pytest.approx(gradients / 2, rel=0.01)
  assert row['estimate']['dcn_s'] == pytest.approx(row['roofline']['dcn_s'], rel=0.02)


@pytest.mark.slow
def test_zero1_across_slices_gathers_and_scatters_between_them_as_the_theory_says():
  """ZeRO-1 over data split across two slices: the updated parameters' all-gather and the
  gradients' reduce-scatter cross the slices as Megascale sends of their operands (a shard, a
  whole input), counted in their results' terms like every other row: the theory's bytes. At
  width 1024 (test_plan's): at 512, XLA:TPU's scatter across the slices moves a quarter more."""
  devices = planner.topology_devices(TOPOLOGY, 2)
  config = config_lib.with_values(test_plan._config(), {
      'mesh.data': 4, 'mesh.fsdp': 2, 'mesh.dcn_data': 2,
      'parallelism.optimizer_sharding': 'zero1'})
  row = planner.plan_candidate(config, 'manual', devices, planner.Hardware.of(devices))
  table = {(r['kind'], r['axes']): r for r in row['communication']}
  for key in (('all-gather', 'dcn'), ('reduce-scatter', 'dcn')):
    assert table[key]['manual']['ratio'] == pytest.approx(1, abs=0.01), key
