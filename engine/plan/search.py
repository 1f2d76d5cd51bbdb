"""engine.plan --search: the layouts that fit an experiment on a topology, found rather than
listed. Every candidate is estimated analytically; the fastest that fit are compiled.

Candidates: each mesh over data, fsdp, tensor, context, stage and expert whose sizes multiply
to the topology's devices (the axes --fixed names held), that the engine accepts; x model.remat
full or dots_with_no_batch_dims_saveable; x micro-batches 1 (with stages: 1x and 2x the stages);
x ZeRO-1 where a data axis holds replicated parameters; x the chunked loss (8 slices, where they
divide); over several slices (--num_slices), x each split of them between the data and fsdp
axes (mesh.dcn_data x mesh.dcn_fsdp). The experiment's other settings stay.

The estimate (`estimate`), per device:
  memory = the train state (parameters and moments, as the layout splits them: exact; the
           moments in host memory with parallelism.offload_optimizer)
         + the gradients (float32, split like the parameters; in auto mode under ZeRO-1 half of
           them: XLA reduce-scatters some to the moments' blocks as the backward pass produces
           them, and half is what the searches' compiles hold, docs/benchmarks.md)
         + two layers' weights gathered over fsdp, in the compute dtype
         + the activations the backward pass keeps: full remat, each local layer's input per
           micro-batch in flight (all micro-batches under GPipe, the stages' count under 1F1B);
           dots_with_no_batch_dims_saveable, every projection's output as well
         + one layer's working set: its inputs, the attention and MLP activations, recomputed
         + the head's logits for one loss chunk: 1.25 x their float32 size (what the compiled
           steps of the Llama-8B search hold: docs/benchmarks.md, "Searched plans");
         + in manual mode under ZeRO-1, the parameters once more (float32, as laid out): the
           updated blocks are gathered into new whole parameters while the step's own are alive;
  time = the FLOPs the step executes / peak + the communication theory's bytes on the wire /
         the interconnect (engine/plan/planner.py's roofline, the theory in place of compiled
         collectives; over several slices, each collective across them split into its part in
         the slice and its part over the data-centre network: engine/analysis/slices.py; with
         parallelism.offload_optimizer, the moments' trip to the chip and back over the host
         link), the serial bound.
Candidates whose memory estimate exceeds HBM are dropped (per mode); the others are ranked by
time, and the best --top are compiled in each mode (planner.plan_candidate), their compiled
memory set beside the estimate. A search writes its rows to OUT.json as it goes and, rerun with
the same flags, compiles only what it has not.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os

import ml_collections
import numpy as np
from absl import logging

from engine import config as config_lib
from engine.analysis import comm_theory, slices
from engine.assemble import VOCABULARY, assemble
from engine.errors import ConfigError
from engine.plan import planner
from engine.plan.step_flops import executed_flops, expert_padding_flops
from engine.sharding import spec_axes

REMATS = ('full', 'dots_with_no_batch_dims_saveable')
LOSS_CHUNKS = 8
# The share of HBM an estimate may fill: the compiler's layout and fragmentation take the rest.
HBM_SHARE = 0.9
# In a search's identity: an OUT.json estimated by another version is not resumed.
ESTIMATE_VERSION = 3


@dataclasses.dataclass(frozen=True)
class Lever:
  """What a candidate sets beside its mesh (and, over several slices, how its data and fsdp
  axes split between them)."""
  remat: str
  microbatches: int
  zero1: bool
  loss_chunks: int
  dcn_data: int = 1
  dcn_fsdp: int = 1

  def values(self) -> dict:
    across = ({'mesh.dcn_data': self.dcn_data, 'mesh.dcn_fsdp': self.dcn_fsdp}
              if self.dcn_data * self.dcn_fsdp > 1 else {})
    return {'model.remat': self.remat, 'train.microbatches': self.microbatches,
            'parallelism.optimizer_sharding': 'zero1' if self.zero1 else 'params',
            'model.loss_chunks': self.loss_chunks, **across}

  def flags(self) -> list[str]:
    return [f'--config.{key}={value}' for key, value in self.values().items()]


def meshes(num_devices: int, fixed: dict[str, int]) -> list[dict[str, int]]:
  """Every assignment of sizes to the mesh axes whose product is `num_devices`, with the
  `fixed` axes at their sizes."""
  divisors = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
  found = []
  for sizes in itertools.product(divisors, repeat=len(config_lib.MESH_AXES)):
    mesh = dict(zip(config_lib.MESH_AXES, sizes))
    if math.prod(sizes) == num_devices and all(mesh[a] == n for a, n in fixed.items()):
      found.append(mesh)
  return found


def levers(config: ml_collections.ConfigDict, mesh: dict[str, int],
           num_slices: int = 1) -> list[Lever]:
  stages = mesh['stage']
  counts = (1,) if stages == 1 else (stages, 2 * stages)
  zero1 = (False, True) if mesh['data'] > 1 else (False,)
  local = config.data.seq_len // mesh['context']
  chunks = (1, LOSS_CHUNKS) if local % LOSS_CHUNKS == 0 else (1,)
  splits = [(d, num_slices // d) for d in range(1, num_slices + 1) if num_slices % d == 0
            and mesh['data'] % d == 0 and mesh['fsdp'] % (num_slices // d) == 0]
  return [Lever(*choice, *split) for choice in itertools.product(REMATS, counts, zero1, chunks)
          for split in splits]


def estimate(run, hardware: planner.Hardware) -> dict:
  """The analytic memory (bytes per device) and serial step time of an assembled candidate."""
  config, setup = run.config, run.setup
  mesh = dict(setup.mesh.shape)
  params, state, offloaded = _train_state(config, setup, mesh)
  transient = _transient_memory(config, setup, mesh)
  memory = state + sum(transient.values())
  gradients = params  # Float32, split like the parameters.
  zero1 = config.parallelism.optimizer_sharding == 'zero1'
  # Under ZeRO-1 auto mode's gradients are partly reduce-scattered as they are made; manual mode
  # gathers the updated blocks into new whole parameters while the step's own are alive: a second
  # float32 copy of them.
  by_mode = {'auto': memory + (gradients / 2 if zero1 else gradients),
             'manual': memory + gradients + (params if zero1 else 0)}
  time, model_flops = _step_time(config, setup, mesh, hardware, host_bytes=2 * offloaded)
  return {'memory_bytes_by_mode': by_mode,
          'state_bytes': state, 'activation_bytes': transient['activations'],
          'logits_bytes': transient['logits'], 'serial_s': time['serial_s'],
          'compute_s': time['compute_s'], 'ici_s': time['ici_s'], 'dcn_s': time['dcn_s'],
          'model_flops': model_flops}


def _train_state(config, setup, mesh: dict[str, int]) -> tuple[float, float, float]:
  """(the parameters, the train state on the chip, the moments offloaded), bytes per device."""
  parameters = setup.parameters()
  params = sum(p.bytes_per_device for p in parameters)
  moments = sum(2 * p.bytes_per_device // _moment_split(p, mesh) for p in parameters)
  # parallelism.offload_optimizer keeps the moments in host memory: each step brings them to
  # the chip and back over the host link.
  offloaded = moments if config.parallelism.offload_optimizer else 0
  return params, params + moments - offloaded, offloaded


def _transient_memory(config, setup, mesh: dict[str, int]) -> dict[str, float]:
  """What the step holds beside its state, bytes per device: the activations the backward pass
  keeps, one layer's working set, the head's logits and the weights gathered over fsdp."""
  model, m = setup.model, config.model
  dtype_bytes = np.dtype(m.dtype).itemsize
  batch_ways = math.prod(mesh[a] for a in setup.rules.mesh_axes('batch', activation=True))
  stages = mesh['stage']
  rows = config.data.global_batch_size // batch_ways // config.train.microbatches
  in_flight = 1 if stages == 1 else (config.train.microbatches if config.train.pipeline_schedule
                                     == 'gpipe' else min(stages, config.train.microbatches))
  tensor = mesh['tensor']
  layers = model.num_layers // stages
  D, F = model.embed_dim, m.mlp_dim
  heads = m.num_heads
  kv = m.num_kv_heads if m.num_kv_heads > 0 else heads
  head_dim = m.head_dim if m.get('head_dim', -1) > 0 else D // heads
  # The projections' outputs: queries, keys, values, attention out, gate, up, down.
  widths = (heads + 2 * kv) * head_dim / tensor + D + 2 * F / tensor + D
  token = rows * (config.data.seq_len // mesh['context'])  # A micro-batch's tokens.
  kept_per_layer = token * D * dtype_bytes
  if m.remat != 'full':
    kept_per_layer += token * widths * dtype_bytes
  vocab = model.vocab_size / (tensor if setup.rules.mesh_axes('vocab', activation=True) else 1)
  layer_params = sum(p.bytes_per_device for p in setup.parameters()
                     if 'layers' in p.logical_axes)
  return {'activations': layers * kept_per_layer * in_flight,
          'working': token * (4 * D + 2 * widths) * 4,
          'logits': 1.25 * token * vocab * 4 / config.model.loss_chunks,
          'gathered': 2 * layer_params / max(layers, 1) * mesh['fsdp'] * dtype_bytes / 4}


def _step_time(config, setup, mesh: dict[str, int], hardware: planner.Hardware,
               host_bytes: float) -> tuple[dict, float]:
  """(the roofline of the executed FLOPs and the theory's collectives, the model's FLOPs)."""
  tokens = config.data.global_batch_size * config.data.seq_len
  model_flops = setup.model.flops_per_token(config.data.seq_len) * tokens
  padding = expert_padding_flops(setup, config.parallelism.mode, tokens, config.data.seq_len)
  theory = slices.split(comm_theory.expected_bytes(setup, config.data.global_batch_size,
                                                   config.data.seq_len), mesh, config.mesh)
  table = {key: {'array_bytes': value} for key, value in theory.items()}
  time = planner.roofline({}, table, hardware, config.model.dtype,
                          planner.slice_shape(mesh, config.mesh),
                          executed_flops(model_flops + padding, config, setup)
                          / hardware.num_devices, host_bytes=host_bytes)
  return time, model_flops


def _moment_split(p, mesh: dict[str, int]) -> int:
  """How many more ways ZeRO-1 splits a parameter's moments than the parameter itself."""
  extra = set(spec_axes(p.moment_spec or p.spec)) - set(spec_axes(p.spec))
  return math.prod(mesh[a] for a in extra)


def search(config: ml_collections.ConfigDict, topology: str, modes: list[str], fixed: dict,
           top: int, out: str | None, dcn_gb_per_s: float | None = None,
           num_slices: int = 1, host_gb_per_s: float | None = None) -> dict:
  """Every candidate on `num_slices` slices of `topology` estimated, the `top` fastest that fit
  compiled in each mode; the rows (estimates and compiled plans) written to OUT.json as they
  come, and read back from it."""
  planner.check_bandwidths(dcn_gb_per_s, host_gb_per_s)
  devices = planner.topology_devices(topology, num_slices)
  hardware = planner.Hardware.of(devices, dcn_gb_per_s, host_gb_per_s)
  identity = {'config': json.loads(config.to_json()), 'topology': topology,
              'num_slices': num_slices, 'fixed': fixed, 'modes': list(modes),
              'dcn_gb_per_s': hardware.dcn_gb_per_s, 'host_gb_per_s': hardware.host_gb_per_s,
              'estimate': ESTIMATE_VERSION}
  done = _resumed(out, identity)
  estimates = done.get('estimates') or _estimates(config, devices, hardware, fixed, num_slices)
  fitting = {mode: fastest_fitting(estimates, hardware.hbm_bytes, mode) for mode in modes}
  if not any(fitting.values()):
    raise ConfigError(f'no candidate on {topology} fits in {hardware.hbm_bytes / 2**30:.1f} GiB '
                      'by the estimate; fix fewer axes (--fixed), or plan a larger topology.')
  result = {'identity': identity, 'topology': topology, 'num_slices': num_slices,
            'chip': hardware.chip.name,
            'devices': hardware.num_devices, 'devices_per_chip': hardware.devices_per_chip,
            'processes': len({d.process_index for d in devices}),
            'hbm_bytes_per_device': hardware.hbm_bytes, 'dcn_gb_per_s': hardware.dcn_gb_per_s,
            'estimates': estimates,
            'fitting_estimates': len({e['key'] for rows in fitting.values() for e in rows}),
            'candidates': done.get('candidates', [])}
  _write(out, result)
  compiled = {(c['key'], c['mode']) for c in result['candidates']}
  chosen = [(mode, e) for mode in modes for e in fitting[mode][:top]]
  count = len(chosen)
  for mode, e in chosen:
    candidate = config_lib.with_values(config, {**{f'mesh.{a}': n for a, n in e['mesh'].items()},
                                                **e['lever']})
    if (e['key'], mode) not in compiled:
      place = f'searched candidate {len(result["candidates"]) + 1} of {count}'
      row = planner.plan_candidate(candidate, mode, devices, hardware, place)
      result['candidates'].append({**row, 'key': e['key'], 'estimate': e})
      _write(out, result)
  planner.rank(result['candidates'])
  return result


def fastest_fitting(estimates: list[dict], hbm_bytes: float,
                    mode: str | None = None) -> list[dict]:
  """The estimates that fit (HBM_SHARE of the chip's HBM) in `mode` (None: in every mode),
  fastest first."""
  return sorted((e for e in estimates if memory_of(e, mode) <= HBM_SHARE * hbm_bytes),
                key=lambda e: e['serial_s'])


def memory_of(estimate_row: dict, mode: str | None = None) -> float:
  """An estimate's memory per device in `mode` (None: the larger of the modes')."""
  by_mode = estimate_row['memory_bytes_by_mode']
  return max(by_mode.values()) if mode is None else by_mode[mode]


def _estimates(config, devices, hardware, fixed, num_slices: int) -> list[dict]:
  """Every candidate the engine accepts, with its estimate."""
  rows = []
  for mesh in filter(lambda mesh: _may_be_accepted(config, mesh), meshes(len(devices), fixed)):
    for lever in levers(config, mesh, num_slices):
      candidate = config_lib.with_values(config, {**{f'mesh.{a}': n for a, n in mesh.items()},
                                                  **lever.values()})
      try:
        run = assemble(candidate, devices, reads=VOCABULARY)
      except ConfigError:
        continue  # The engine refuses it: not a candidate.
      key = 'x'.join(str(mesh[a]) for a in config_lib.MESH_AXES) + ' ' + ' '.join(lever.flags())
      rows.append({'key': key, 'mesh': mesh, 'lever': lever.values(),
                   **estimate(run, hardware)})
  logging.info('Estimated %d candidates over %d meshes.', len(rows),
               len({tuple(r['mesh'].values()) for r in rows}))
  return rows


def _may_be_accepted(config: ml_collections.ConfigDict, mesh: dict[str, int]) -> bool:
  """Bounds every mesh the engine accepts meets (it checks more, and exactly, in `assemble`):
  checked first because a pod has thousands of meshes and assembling one takes milliseconds."""
  m, data = config.model, config.data
  experts = m.get('num_experts', 0)
  return ((mesh['expert'] == 1 or (experts > 0 and experts % mesh['expert'] == 0))
          and mesh['stage'] <= m.num_layers
          and mesh['data'] * mesh['fsdp'] <= data.global_batch_size
          and mesh['context'] <= data.seq_len)


def _resumed(out: str | None, identity: dict) -> dict:
  """What an earlier search with the same flags wrote to OUT.json ({} without one)."""
  if not out or not os.path.exists(out + '.json'):
    return {}
  with open(out + '.json') as f:
    done = json.load(f)
  if done.get('identity') != json.loads(json.dumps(identity)):
    raise ConfigError(f'--out={out}: {out}.json holds another search (config, topology, '
                      '--num_slices, --fixed, --modes or a bandwidth differ); pass a new --out, '
                      'or the same flags to resume it.')
  logging.info('Resuming the search in %s.json: %d compiled candidate(s) kept.', out,
               len(done.get('candidates', [])))
  return done


def _write(out: str | None, result: dict) -> None:
  if not out:
    return
  with open(out + '.json.tmp', 'w') as f:
    json.dump(result, f, indent=1, default=str)
  os.replace(out + '.json.tmp', out + '.json')
