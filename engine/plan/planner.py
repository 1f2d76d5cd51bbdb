"""Plan a pod run before booking it: the experiment's real train step compiled ahead of time for
a TPU topology, on this machine, without a TPU (libtpu's compiler: `pip install -e '.[tpu]'`).

  python -m engine.plan --config=experiments/llama_8b.py --topology=v5p:4x4x8 \
      --meshes=16x8x1,1x32x4,1x128x1 --modes=auto,manual --out=/tmp/plan

For every candidate layout (a mesh from --meshes, or the config's own) and mode, the train step
is built by the code that trains (engine.assemble and the mode's step builder, on the
topology's devices instead of this machine's), lowered and compiled, never run. Each candidate
gets:
  - memory per device from the compiled program (arguments, temporaries, peak) against the
    chip's HBM: fits or does not fit (a compile that runs out of HBM is a "does not fit" with
    the compiler's numbers, not an error);
  - its collectives by kind and mesh axes (engine.analysis.collectives on the TPU HLO) against
    the communication theory (engine.analysis.comm_theory);
  - a roofline estimate of the step time from the compiled cost analysis and the chip's
    published figures (engine.chips): compute = FLOPs / peak, memory = bytes accessed /
    HBM bandwidth, communication = each collective's bytes on the wire / interconnect bandwidth
    (DCN bandwidth for axes split across slices). The step takes at least the largest of the
    three (perfect overlap) and at most their sum (compute or memory, then communication): both
    are printed, and the MFU the slower one implies; a mixture of experts' compute also counts
    the expert rows its dispatch pads (engine/plan/step_flops.py), and its row the all-to-all bytes
    per step and device (the experts' exchange), the theory's and the compiled program's;
  - the config (JSON) and the command line that trains it.
Candidates are ranked by the slower estimate, those that fit first. With --search the candidates
are found instead of listed (engine/plan/search.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tempfile

# The plan compiles for the topology and runs nothing: CPU even on a TPU VM, which `import engine`
# leaves to JAX (engine/runtime/platforms.py). libtpu still loads: jax.experimental.topologies
# needs it.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Several plans may load libtpu at once (it takes a lock by default); without a TPU host these
# settings only keep libtpu from guessing (and warning about) one.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
os.environ.setdefault('TPU_ACCELERATOR_TYPE', 'v5p-8')

import ml_collections  # noqa: E402
from absl import logging  # noqa: E402

from engine import chips, parallel, validation  # noqa: E402
from engine import config as config_lib  # noqa: E402
from engine.analysis import benchmark, collectives, comm_theory, slices, verdicts  # noqa: E402
from engine.assemble import VOCABULARY, assemble  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.hf import load as hf  # noqa: E402
from engine.analysis.hlo import matmul_types  # noqa: E402
from engine.plan import peak_memory  # noqa: E402
from engine.plan.step_flops import (executed_flops, expert_padding_flops, head_copies,  # noqa: E402
                                    head_flops, quantized_flops)
from engine.runtime.progress import phase  # noqa: E402
from engine.train.metrics import log_memory  # noqa: E402

_TOPOLOGY = re.compile(r'^(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)$')
# What the planner assumes where engine/chips.py has no published figure, GB/s per chip: the
# data-centre network between slices, and the link to host memory, both directions together
# (what `python -m engine.bench.host_link` measured on a TPU v5e host: docs/benchmarks.md).
# Set --dcn_gb_per_s and --host_gb_per_s to your machines'.
DCN_GB_PER_S = 12.5
HOST_GB_PER_S = 14.0
# Bytes each device sends per byte of a collective's result, for a group of n devices on a ring.
_WIRE_FACTOR = {
    'all-reduce': lambda n: 2 * (n - 1) / n,  # Reduce-scatter, then all-gather.
    'all-gather': lambda n: (n - 1) / n,  # Result: the whole array.
    'reduce-scatter': lambda n: n - 1,  # Result: one shard.
    'all-to-all': lambda n: (n - 1) / n,
    'collective-permute': lambda n: 1,
}


class PlanError(ConfigError):
  """A plan that cannot start (unknown topology, no libtpu)."""


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """The devices of a TPU topology ('v5p:4x4x8'), for compiling, not running."""
  if not _TOPOLOGY.match(topology):
    raise PlanError(f'--topology={topology!r} is not a TPU topology; write VERSION:SHAPE with '
                    'VERSION one of v4, v5e, v5p, v6e and SHAPE its chips per dimension, e.g. '
                    'v5p:4x4x8 (v5p-256), v5e:4x4 (v5e-16), v6e:8x8.')
  if num_slices < 1:
    raise PlanError(f'--num_slices={num_slices} must be >= 1.')
  try:
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
    return list(topologies.get_topology_desc(
        platform='tpu', topology_name=topology, num_slices=num_slices).devices)
  except (RuntimeError, ValueError) as e:
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    if 'INVALID_ARGUMENT' not in message:
      raise PlanError(f'--topology={topology!r}: cannot build the TPU compiler ({message}); '
                      "install it with pip install -e '.[tpu]'.") from e
    raise PlanError(f'--topology={topology!r} is not a topology libtpu knows ({message}); '
                    'check the shape against the version\'s slice shapes (v5p: AxBxC, v5e and '
                    'v6e: AxB).') from e


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What the roofline needs to know of the planned devices."""
  chip: chips.Chip
  devices_per_chip: int  # TPU v4's topology lists each TensorCore as a device.
  num_devices: int
  num_slices: int
  dcn_gb_per_s: float
  host_gb_per_s: float

  @classmethod
  def of(cls, devices, dcn_gb_per_s: float | None = None,
         host_gb_per_s: float | None = None) -> Hardware:
    """The devices' chip and counts; the bandwidths given, else the chip's published ones, else
    the planner's assumptions."""
    chip = chips.chip_of(devices[0].device_kind)
    if chip is None:
      raise PlanError(f'{devices[0].device_kind!r} is not in engine/chips.py; add its '
                      'published figures there.')
    places = {(getattr(d, 'slice_index', 0), tuple(d.coords)) for d in devices}
    return cls(chip, len(devices) // len(places), len(devices),
               validation.count_slices(devices),
               dcn_gb_per_s or chip.dcn_gb_per_s or DCN_GB_PER_S,
               host_gb_per_s or chip.host_gb_per_s or HOST_GB_PER_S)

  def per_device(self, per_chip: float) -> float:
    return per_chip / self.devices_per_chip

  @property
  def hbm_bytes(self) -> float:
    return self.per_device(self.chip.hbm_gib * 2**30)


def slice_shape(mesh_shape: dict[str, int], mesh_config) -> dict[str, int]:
  """The mesh axes' sizes within one slice: data and fsdp are split over mesh.dcn_data and
  mesh.dcn_fsdp slices, and a collective's group in a slice spans only its part of them."""
  return {a: n // mesh_config.get(f'dcn_{a}', 1) for a, n in mesh_shape.items()}


def check_bandwidths(dcn_gb_per_s: float | None, host_gb_per_s: float | None) -> None:
  """--dcn_gb_per_s and --host_gb_per_s, where given, before anything compiles."""
  for flag, value in (('dcn_gb_per_s', dcn_gb_per_s), ('host_gb_per_s', host_gb_per_s)):
    if value is not None and not value > 0:
      raise ConfigError(f'--{flag}={value:g} must be a positive number.')


def host_traffic(memory: dict) -> float:
  """Bytes a step moves over the host link: offloaded activations (model.remat=offload_*) go to
  host memory in the forward pass and come back in the backward; offloaded optimizer state
  (parallelism.offload_optimizer) comes to the chip and goes back."""
  return 2 * (memory.get('host_temp_size_in_bytes', 0)
              + memory.get('host_argument_size_in_bytes', 0))


def roofline(cost: dict, table: dict, hardware: Hardware, dtype: str,
             mesh_shape: dict[str, int], executed_flops: float,
             quantized: tuple[str, float] = ('default', 0.0), host_bytes: float = 0.0) -> dict:
  """Seconds per step for compute, HBM traffic and communication, and the two estimates.

  XLA's cost analysis counts a loop body once, so with scanned layers its FLOPs and bytes cover
  one layer of each loop: compute uses `executed_flops` (what the step really runs, per device)
  where that is larger, and the HBM time is a lower bound. `quantized`: (precision, FLOPs per
  device of the quantized projections), which run at the chip's peak for that precision.
  `mesh_shape`: the axes' sizes in one slice (`slice_shape`); `dcn` rows span the slices.
  `host_bytes`: what the step moves over the host link (`host_traffic`), timed like the
  communication."""
  peak = hardware.per_device(hardware.chip.peak_tflops[dtype] * 1e12)
  flops = max(float(cost.get('flops', 0.0)), executed_flops)
  precision, fast = quantized[0], min(quantized[1], flops)
  compute_s = (flops - fast) / peak
  if fast:
    compute_s += fast / hardware.per_device(hardware.chip.peak_tflops[precision] * 1e12)
  memory_s = float(cost.get('bytes accessed', 0.0)) / hardware.per_device(
      hardware.chip.hbm_gb_per_s * 1e9)
  comm_s = {'ici': 0.0, 'dcn': 0.0}
  sizes = {**mesh_shape, collectives.DCN: hardware.num_slices}
  for (kind, axes), row in table.items():
    group = math.prod(sizes[a] for a in axes)
    if group < 2 or not row['array_bytes'] or kind not in _WIRE_FACTOR:
      continue
    wire = row['array_bytes'] * _WIRE_FACTOR[kind](group)
    if collectives.DCN in axes:  # Between slices: Megascale's sends (engine.analysis.collectives).
      comm_s['dcn'] += wire / (hardware.dcn_gb_per_s * 1e9)
    else:
      comm_s['ici'] += wire / hardware.per_device(hardware.chip.interconnect_gb_per_s * 1e9)
  host_s = host_bytes / hardware.per_device(hardware.host_gb_per_s * 1e9)
  communication_s = comm_s['ici'] + comm_s['dcn'] + host_s
  return {'compute_s': compute_s, 'memory_s': memory_s, 'ici_s': comm_s['ici'],
          'dcn_s': comm_s['dcn'], 'host_s': host_s, 'host_bytes': host_bytes,
          'overlapped_s': max(compute_s, memory_s, communication_s),
          'serial_s': max(compute_s, memory_s) + communication_s,
          'flops_per_device': flops, 'compiled_flops_per_device': float(cost.get('flops', 0.0)),
          'bytes_accessed_per_device': float(cost.get('bytes accessed', 0.0))}


# "... memory required for HLO temporaries (132.87G) exceeds available HBM (95.74G)."
_OUT_OF_MEMORY = re.compile(r'\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)')


def _out_of_memory(error: Exception) -> dict | None:
  """The compiler's own figures when a program does not fit in HBM, else None."""
  text = str(error)
  if 'RESOURCE_EXHAUSTED' not in text and 'out of memory' not in text.lower():
    return None
  scale = {None: 1, '': 1, 'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}
  if m := _OUT_OF_MEMORY.search(text):
    return {'needed_bytes': float(m.group(1)) * scale[m.group(2)],
            'hbm_bytes': float(m.group(3)) * scale[m.group(4)]}
  return {'needed_bytes': None, 'hbm_bytes': None}


def _compile(run, what: str, breakdown_row: dict | None):
  """(the compiled train step or None, compile seconds, the compile's exception or None); with
  `breakdown_row`, the compiler also writes its memory reports, and the row gets their
  breakdown (engine.plan.peak_memory) whether the step fits or not."""
  with tempfile.TemporaryDirectory() as dump:
    compiled, error = None, None
    try:
      with phase(f'the train step, {what}') as timer:
        compiled = run.compile_train_step(compiler_options=None if breakdown_row is None else
                                          peak_memory.dump_options(dump))
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if breakdown_row is not None:
      breakdown_row['peak_memory'] = peak_memory.breakdown(dump)
      if breakdown_row['peak_memory'] is None:  # Served from a compilation cache.
        logging.warning('No memory report for %s: the compiler wrote none (a cached program?).',
                        what)
  return compiled, timer.seconds, error


def plan_candidate(config: ml_collections.ConfigDict, mode: str, devices,
                   hardware: Hardware, place: str = 'the candidate',
                   memory_breakdown: bool = False) -> dict:
  """Compiles one candidate (config with its mesh) for one mode; returns its plan row. `place`
  names it in the progress lines ('candidate 2 of 6'); `memory_breakdown`: the row also
  carries the largest chunks of the compiled step's memory layout (engine.plan.peak_memory),
  whether it fits or not."""
  config = config_lib.with_values(config, {'parallelism.mode': mode})
  row = {'mode': mode, 'config': json.loads(config.to_json())}
  try:
    run = assemble(config, devices, reads=VOCABULARY)
    train_setup = run.setup
  except ConfigError as e:  # A candidate the engine would refuse: a row, not a stop.
    sizes = config_lib.format_mesh(config.mesh, all_axes=True)
    logging.info('Skipped %s, %s on %s: the engine refuses it.', place, mode, sizes)
    return {**row, 'mesh': sizes, 'status': 'invalid', 'error': str(e)}
  mesh_shape = dict(train_setup.mesh.shape)
  row.update(mesh=benchmark.mesh_name(mesh_shape), mesh_shape=mesh_shape)
  compiled, compile_s, error = _compile(run, f'{mode} on {row["mesh"]} ({place})',
                                        row if memory_breakdown else None)
  if error is not None:
    if (oom := _out_of_memory(error)) is None:
      raise error
    logging.info('The %s train step on %s does not fit in HBM (%s)%s.', mode, row['mesh'], place,
                 '' if memory_breakdown else '; --memory_breakdown lists the buffers that make '
                 'its peak')
    return {**row, 'status': 'does not fit', 'compile_s': compile_s,
            'memory': {'peak_estimate_bytes': oom['needed_bytes'],
                       'temp_size_in_bytes': oom['needed_bytes']},
            'hbm_bytes': hardware.hbm_bytes, 'error': str(error).splitlines()[0][:300]}
  return _compiled_row(row, run, compiled, compile_s, hardware)


def _compiled_row(row: dict, run, compiled, compile_s: float, hardware: Hardware) -> dict:
  """A compiled candidate's plan row: its memory, collectives against the theory, roofline
  and MFU."""
  config, train_setup, mode = run.config, run.setup, row['mode']
  mesh_shape, global_batch, seq_len = (row['mesh_shape'], config.data.global_batch_size,
                                       config.data.seq_len)
  memory = log_memory(f'{mode} {row["mesh"]} train step', compiled)
  found = collectives.count_collectives(compiled.as_text(), train_setup.mesh)
  table = collectives.summarize(found)
  theory = slices.split(comm_theory.expected_bytes(train_setup, global_batch, seq_len),
                        mesh_shape, config.mesh)
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  tokens = global_batch * seq_len
  model_flops = train_setup.model.flops_per_token(seq_len) * tokens
  padding = expert_padding_flops(train_setup, mode, tokens, seq_len)
  estimate = roofline(cost, table, hardware, config.model.dtype,
                      slice_shape(mesh_shape, config.mesh),
                      executed_flops(model_flops + padding, config, train_setup)
                      / hardware.num_devices,
                      (config.model.matmul_precision,
                       quantized_flops(train_setup, config) / hardware.num_devices),
                      host_traffic(memory))
  peak = hardware.per_device(hardware.chip.peak_tflops[config.model.dtype] * 1e12)
  fits = memory['peak_estimate_bytes'] <= hardware.hbm_bytes
  mode_run = benchmark.ModeRun(mode, train_setup, compiled, compile_s, memory, found)
  communication = verdicts.communication_table([mode_run], theory)
  flags = verdicts.off_theory(communication, [mode],
                              verdicts.context_for(train_setup, config, 'tpu'), row['mesh'])
  verdicts.log(flags)
  return {
      **row, 'status': 'fits' if fits else 'does not fit', 'compile_s': compile_s,
      'memory': memory, 'hbm_bytes': hardware.hbm_bytes, 'roofline': estimate,
      'tokens_per_step': tokens, 'model_flops_per_step': model_flops,
      'expert_padding_flops_per_step': padding,
      # The head's share of the executed FLOPs, per device: 1 / stages of it where 1F1B splits
      # the head over the stages.
      'head_flops_per_device': (head_flops(train_setup, config)
                                * head_copies(train_setup, config) / hardware.num_devices),
      'mfu': model_flops / (hardware.num_devices * peak * estimate['serial_s']),
      'mfu_overlapped': model_flops / (hardware.num_devices * peak * estimate['overlapped_s']),
      'communication': communication,
      # Operand types of the compiled step's matmuls ('s8 x s8': int8 projections), and count.
      'matmul_types': matmul_types(compiled.as_text()),
      'off_theory': [dataclasses.asdict(f) for f in flags],
      # The experts' exchange per step and device, bytes of the results (theory, compiled).
      'all_to_all_bytes': {'theory': sum(b for (k, _), b in theory.items() if k == 'all-to-all'),
                           'compiled': sum(r['array_bytes'] for (k, _), r in table.items()
                                           if k == 'all-to-all')},
  }


def rank(rows: list[dict]) -> None:
  """Sets each row's rank: those that fit first, then by the serial step time."""
  order = lambda r: (r['status'] != 'fits', r.get('roofline', {}).get('serial_s', math.inf))
  for place, row in enumerate(sorted(rows, key=order), 1):
    row['rank'] = place


def plan(config: ml_collections.ConfigDict, topology: str, num_slices: int, modes: list[str],
         meshes: list[str], dcn_gb_per_s: float | None = None,
         memory_breakdown: bool = False, host_gb_per_s: float | None = None) -> dict:
  """Every candidate (mesh x mode) compiled for the topology, ranked (`memory_breakdown`:
  plan_candidate's)."""
  parallel.check_modes(modes, '--modes')
  check_bandwidths(dcn_gb_per_s, host_gb_per_s)
  for mesh in meshes:
    config_lib.parse_mesh(mesh, '--meshes')  # Every mesh string checked before anything compiles.
  devices = topology_devices(topology, num_slices)
  hardware = Hardware.of(devices, dcn_gb_per_s, host_gb_per_s)
  precision = config.model.matmul_precision
  if precision != 'default' and precision not in hardware.chip.peak_tflops:
    has = [p for p in ('int8', 'fp8') if p in hardware.chip.peak_tflops]
    raise ConfigError(f'model.matmul_precision={precision!r}: {hardware.chip.name} has no '
                      f'{precision} matmul units (engine/chips.py); choose '
                      f"{' or '.join(map(repr, has + ['default']))}.")
  num_processes = len({d.process_index for d in devices})
  config = hf.with_model_config(config)  # train.init_from=hf:DIR: plan DIR's model, once.
  rows, count = [], len(meshes or ['']) * len(modes)
  for mesh in meshes or ['']:
    candidate = config_lib.with_values(config, config_lib.mesh_values(mesh, '--meshes')
                                       if mesh else {})
    for mode in modes:
      place = f'candidate {len(rows) + 1} of {count}'
      rows.append(plan_candidate(candidate, mode, devices, hardware, place,
                                 memory_breakdown=memory_breakdown))
  if all(row['status'] == 'invalid' for row in rows):
    raise ConfigError(f'no candidate can run on {topology}; the first, mesh '
                      f'{rows[0]["mesh"]}: {rows[0]["error"]}')
  rank(rows)
  return {'topology': topology, 'num_slices': num_slices, 'chip': hardware.chip.name,
          'devices': hardware.num_devices, 'devices_per_chip': hardware.devices_per_chip,
          'processes': num_processes, 'hbm_bytes_per_device': hardware.hbm_bytes,
          'dcn_gb_per_s': hardware.dcn_gb_per_s, 'host_gb_per_s': hardware.host_gb_per_s,
          'candidates': rows}
