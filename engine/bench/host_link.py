"""How fast the link to host memory moves an offloaded optimizer state: an array in host memory
(pinned_host) brought to the chip, updated there and written back, its host buffer donated, as
the train step does with `parallelism.offload_optimizer` (engine/state.py). Medians of --repeats
calls after a warm-up, on the default device; the GB/s count both directions together, as
engine.plan's --host_gb_per_s does.

  python -m engine.bench.host_link [--mib=256,1024 --repeats=7]

On CPU devices, whose memory is the host's, it refuses in one line.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from absl import flags

from engine.bench.timing import median_ms
from engine.cli.command_line import run_command
from engine.errors import ConfigError

_MIB = flags.DEFINE_list('mib', ['256', '1024'], 'Sizes of the offloaded array, MiB.')
_REPEATS = flags.DEFINE_integer('repeats', 7, 'Timed round trips per size.')


def main(argv):
  del argv
  sizes = _sizes()
  device = jax.devices()[0]
  if device.platform == 'cpu' or 'pinned_host' not in {
      m.kind for m in device.addressable_memories()}:
    raise ConfigError(f'{device.platform} devices have no link to host memory to measure (a '
                      'CPU\'s device memory is the host\'s); run this on a TPU or GPU.')
  on_chip = jax.sharding.SingleDeviceSharding(device)
  on_host = on_chip.with_memory_kind('pinned_host')

  @functools.partial(jax.jit, out_shardings=on_host, donate_argnums=0)
  def round_trip(state):
    return jax.device_put(state, on_chip) * 1.0001

  print(f'{device.device_kind}: host -> chip -> host round trip of a donated float32 array')
  print('| MiB | median ms | GB/s, both directions together |')
  print('|---:|---:|---:|')
  for mib in sizes:
    state = [jax.device_put(np.ones(mib * 2**18, np.float32), on_host)]

    def step():  # Each call donates the previous call's output.
      state[0] = round_trip(state[0])
      return state[0]

    ms = median_ms(step, repeats=_REPEATS.value)
    print(f'| {mib} | {ms:.1f} | {2 * mib * 2**20 / (ms / 1e3) / 1e9:.1f} |')


def _sizes() -> list[int]:
  if not all(s.isdigit() and int(s) > 0 for s in _MIB.value) or _REPEATS.value < 1:
    raise ConfigError(f'--mib={",".join(_MIB.value)} must list positive integers (MiB) and '
                      f'--repeats={_REPEATS.value} be at least 1.')
  return [int(s) for s in _MIB.value]


if __name__ == '__main__':
  run_command(main, 'engine.bench.host_link')
