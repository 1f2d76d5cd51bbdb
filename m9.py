"""Measurements for issue 9's closing note (not part of the project)."""
import os, sys
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
import jax, numpy as np
from engine import parallel
from engine.analysis import collectives
from engine.train import build_setup
from experiments import llama_bench

def compiled(config, mode):
  s = build_setup(config, 256)
  b = s.abstract_batch(config.data.global_batch_size, config.data.seq_len)
  c = parallel.STEP_BUILDERS[mode](s).train.lower(s.abstract_state(), b).compile()
  return c, collectives.summarize(collectives.count_collectives(c.as_text(), s.mesh))

what = sys.argv[1]
if what == 'remat':
  for mesh in ['8x1x1', '1x8x1', '2x2x2']:
    for mode in ['auto', 'manual']:
      row = []
      for policy in ['none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable']:
        config = llama_bench.get_config(f'mesh={mesh},mode={mode},remat={policy}')
        m = compiled(config, mode)[0].memory_analysis()
        row.append(f'{policy}: temp {m.temp_size_in_bytes/2**20:.2f} MiB, args {m.argument_size_in_bytes/2**20:.2f}')
      print(mesh, mode, ' | '.join(row), flush=True)
elif what == 'micro':
  for mesh in ['8x1x1', '1x8x1', '2x2x2']:
    for mode in ['auto', 'manual']:
      for k in [1, 4]:
        config = llama_bench.get_config(f'mesh={mesh},mode={mode},batch=32,microbatches={k}')
        c, table = compiled(config, mode)
        m = c.memory_analysis()
        rows = ', '.join(f'{kind}[{",".join(axes)}] x{v["executions"]} {v["array_bytes"]/1024:.0f} KiB'
                         for (kind, axes), v in table.items() if v['array_bytes'])
        print(f'{mesh} {mode} k={k}: temp {m.temp_size_in_bytes/2**20:.1f} MiB; {rows}', flush=True)
elif what == 'bf16':
  from tests.helpers import engine_run, single_device_run
  from tests.test_llama import llama_config
  ref = single_device_run(llama_config(steps=3), 3)
  for mode, rd in [('auto', 'float32'), ('manual', 'float32'), ('manual', 'bfloat16')]:
    config = llama_config((2, 2, 2), steps=3)
    config.model.dtype = 'bfloat16'
    config.parallelism.grad_reduce_dtype = rd
    run = engine_run(config, mode, 3)
    print(mode, rd, 'loss rel', np.abs(run.losses / ref.losses - 1).max(), 'norm rel',
          np.abs(run.grad_norms / ref.grad_norms - 1).max(), flush=True)
