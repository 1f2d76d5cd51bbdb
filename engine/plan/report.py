"""The plan's report (engine.plan): the ranking as Markdown, each candidate's collectives against
the theory, and the command line that trains it."""

from __future__ import annotations

import ml_collections

from engine import chips
from engine import config as config_lib
from engine.analysis import verdicts
from engine.analysis.verdicts import LOWER_BOUND_NOTE, element_types, lower_bound
from engine.plan import planner, search


def train_command(config_arg: str, overrides: list[str], mesh: dict[str, int], mode: str,
                  config) -> str:
  """The command line that trains this candidate: the plan's config file and overrides, its
  mesh and its mode."""
  mesh_flags = [f'--config.mesh.{a}={mesh[a]}' for a in config_lib.MESH_AXES]
  mesh_flags += [f'--config.mesh.dcn_{a}={config.mesh[f"dcn_{a}"]}' for a in ('data', 'fsdp')
                 if config.mesh[f'dcn_{a}'] > 1]
  kept = [o for o in overrides
          if not o.startswith(('--config.mesh.', '--config.parallelism.mode='))]
  return ' '.join(['python -m engine.main', f'--config={config_arg}', *kept, *mesh_flags,
                   f'--config.parallelism.mode={mode}', '--workdir=WORKDIR'])


def _gib(n) -> str:
  return '?' if n is None else f'{n / 2**30:.2f}'


def _ranking(result: dict) -> list[str]:
  """The ranking table; with a mixture of experts, a column of the experts' all-to-all bytes."""
  moe = any(r.get('config', {}).get('model', {}).get('num_experts') for r in result['candidates'])
  host = any(planner.host_traffic(r.get('memory', {})) for r in result['candidates'])
  exchange = ' all-to-all MiB (theory / compiled) |' if moe else ''
  lines = [
      '| rank | mesh | mode | fits | peak GiB | args GiB | temp GiB |' +
      (' host GiB |' if host else '') + ' TFLOP / device | compute ms '
      '| HBM ms | ICI ms | DCN ms |' + (' host ms |' if host else '') +
      f' step ms (overlapped - serial) | MFU (serial) |{exchange} compile s |',
      '|---:|---|---|---|---:|---:|---:|' + '---:|' * host +
      '---:|---:|---:|---:|---:|' + '---:|' * host + '---|---:|' + '---:|' * (1 + moe)]
  for r in sorted(result['candidates'], key=lambda r: r.get('rank', 0)):
    if r['status'] == 'invalid':
      lines.append(f'| - | {r["mesh"]} | {r["mode"]} | invalid: {r["error"]} |' +
                   ' |' * (11 + moe + 2 * host))
      continue
    m, e = r['memory'], r.get('roofline')
    cells = [str(r['rank']), r['mesh'], r['mode'], '**yes**' if r['status'] == 'fits' else 'no',
             _gib(m.get('peak_estimate_bytes')), _gib(m.get('argument_size_in_bytes')),
             _gib(m.get('temp_size_in_bytes'))]
    if host:  # What the host keeps: half of what the step moves.
      cells.append(_gib(planner.host_traffic(m) / 2))
    if e:
      ms = lambda seconds: f'{seconds * 1e3:.3g}'  # Three digits, from microseconds to hours.
      cells += [f'{e["flops_per_device"] / 1e12:.3g}', ms(e['compute_s']), ms(e['memory_s']),
                ms(e['ici_s']), ms(e['dcn_s']), *([ms(e['host_s'])] if host else []),
                f'{ms(e["overlapped_s"])} - {ms(e["serial_s"])}', f'{100 * r["mfu"]:.1f} %']
    else:
      cells += ['-'] * (7 + host)
    if moe:
      a2a = r.get('all_to_all_bytes')
      cells.append(f'{a2a["theory"] / 2**20:.1f} / {a2a["compiled"] / 2**20:.1f}' if a2a else '-')
    cells.append(f'{r["compile_s"]:.0f}')
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


def _peak_memory(result: dict) -> list[str]:
  """Per candidate compiled with --memory_breakdown: its largest chunks of memory at the peak
  (engine.plan.peak_memory)."""
  lines = []
  for r in result['candidates']:
    if not r.get('peak_memory'):
      continue
    peak = r['peak_memory']
    lines += [f'## {r["mesh"]}, {r["mode"]}: memory at the peak, '
              f'{_gib(peak["total_bytes"])} GiB per device', '',
              '| GiB | values sharing the chunk | made by (a value of one of its shapes) |',
              '|---:|---|---|']
    lines += [f'| {_gib(c["bytes"])} | `{c["shapes"][:160]}` | `{c["op_name"][-160:] or "?"}` |'
              for c in peak['chunks']]
    lines.append('')
  return lines


def markdown(result: dict, config_arg: str, overrides: list[str] = ()) -> str:
  """The plan as Markdown: the ranking, then each candidate's collectives against the theory."""
  c0 = result['candidates'][0]['config']
  lines = [
      f'# Plan: {c0["model"]["name"]}, {c0["model"]["num_layers"]} layers, width '
      f'{c0["model"]["embed_dim"]}, sequence {c0["data"]["seq_len"]}, batch '
      f'{c0["data"]["global_batch_size"]}, {c0["model"]["dtype"]}, remat {c0["model"]["remat"]} '
      f'on {result["topology"]} x {result["num_slices"]} slice(s): {result["devices"]} x '
      f'{result["chip"]} devices, {_gib(result["hbm_bytes_per_device"])} GiB HBM each', '',
      *_ranking(result), '',
      *verdicts.markdown([verdicts.Flag(**f) for r in result['candidates']
                          for f in r.get('off_theory', [])])]
  lines += ['', 'Peak: arguments + outputs + temporaries - donated, from the compiled program '
            '(a compile that ran out of HBM: the HLO temporaries the compiler needed). Step time: '
            'compute = FLOPs executed / peak (the model\'s 6N + attention, 8N for the layers '
            'under full remat or 1F1B, plus the pipeline bubble, the head on every stage unless '
            '1F1B splits it, and a mixture of experts\' padded slots: engine/plan/'
            'step_flops.py; XLA\'s cost analysis counts a scanned layer once), HBM = '
            'compiled bytes accessed / bandwidth (a lower bound, for the same reason), ICI and '
            'DCN = bytes on the wire / bandwidth (ring algorithms; every link of the chip for '
            f'ICI: a lower bound; DCN at {result.get("dcn_gb_per_s", 0):g} GB/s per chip), host '
            '= the bytes offloaded state and activations move to host memory and back / the '
            f'host link ({result.get("host_gb_per_s", 0):g} GB/s per chip); overlapped = the '
            'largest, serial = max(compute, HBM) + communication (ICI, DCN and host). MFU: the '
            'model\'s FLOPs per serial step time, against the compute dtype\'s peak; with '
            'model.matmul_precision int8 or fp8 the quantized projections\' FLOPs are timed at '
            'that precision\'s peak (engine/chips.py).', '']
  lines += [chips.TPU_NOTES, '']
  if any(r['status'] == 'does not fit' and 'peak_memory' not in r for r in result['candidates']):
    lines += ['A candidate does not fit: `--memory_breakdown` lists the buffers that make its '
              'peak (the compiler\'s memory layout).', '']
  lines += _peak_memory(result)
  for r in result['candidates']:
    if r['status'] == 'invalid' or 'communication' not in r:
      continue
    lines += [f'## {r["mesh"]}, {r["mode"]}: collectives per step and device', '',
              '| kind | axes | executions | MiB | types | theory MiB | measured / theory |',
              '|---|---|---:|---:|---|---:|---:|']
    for row in r['communication']:
      e = row[r['mode']]
      ratio = lower_bound(e, f'{e["ratio"]:.2f}') if e['ratio'] is not None else (
          'not in theory' if e['unexpected'] else '-')
      if verdicts.is_off(e):
        ratio = f'**{ratio}**'
      executions = lower_bound(e, e['executions']) + (
          " (a loop's trip count unknown)" if e.get('lower_bound') else '')
      mib = lower_bound(e, f'{e["bytes"] / 2**20:.1f}')
      lines.append(f'| {row["kind"]} | {row["axes"]} | {executions} | {mib} | '
                   f'{element_types(e)} | {row["theory_bytes"] / 2**20:.1f} | {ratio} |')
    if any(row[r['mode']].get('lower_bound') for row in r['communication']):
      lines += ['', f'**Lower bounds**: {LOWER_BOUND_NOTE} The ICI and DCN times of this '
                'candidate are lower bounds too.']
    if r.get('matmul_types'):
      kinds = ', '.join(f'{pair}: {n}' for pair, n in r['matmul_types'].items())
      lines += ['', f'Matmuls of the compiled step by operand types: {kinds}.']
    command = train_command(config_arg, list(overrides), r['mesh_shape'], r['mode'],
                            ml_collections.ConfigDict(r['config']))
    lines += ['', f'Train it: `{command}`', '']
  return '\n'.join(lines)


def search_markdown(result: dict, config_arg: str, overrides: list[str] = ()) -> str:
  """A search's report (engine/plan/search.py): the compiled candidates ranked, each with its
  estimate beside the compiled numbers and its training command; then the best estimates."""
  estimates, compiled = result['estimates'], result['candidates']
  slices = (f' x {result["num_slices"]} slices' if result.get('num_slices', 1) > 1 else '')
  lines = [f'# Search on {result["topology"]}{slices}: {result["devices"]} x {result["chip"]} '
           f'devices, {_gib(result["hbm_bytes_per_device"])} GiB HBM each', '',
           f'{len(estimates)} candidates estimated over '
           f'{len({tuple(e["mesh"].values()) for e in estimates})} meshes, '
           f'{result["fitting_estimates"]} fit by the estimate; the fastest compiled:', '',
           '| rank | mesh | levers | mode | fits | peak GiB: estimate / compiled | step ms: '
           'estimate / compiled (serial) | MFU (serial) |',
           '|---:|---|---|---|---|---|---|---:|']
  for r in sorted(compiled, key=lambda r: r.get('rank', 0)):
    e, m, roof = r['estimate'], r.get('memory', {}), r.get('roofline')
    peak = m.get('peak_estimate_bytes')
    lines.append(
        f'| {r.get("rank", "-")} | {r["mesh"]} | {_levers(e["lever"])} | {r["mode"]} | '
        f'{"**yes**" if r["status"] == "fits" else r["status"]} | '
        f'{_gib(search.memory_of(e, r["mode"]))} / {_gib(peak)} | {e["serial_s"] * 1e3:.0f} / '
        f'{roof["serial_s"] * 1e3:.0f} | {100 * r["mfu"]:.1f} % |' if roof else
        f'| - | {r["mesh"]} | {_levers(e["lever"])} | {r["mode"]} | {r["status"]} | '
        f'{_gib(search.memory_of(e, r["mode"]))} / {_gib(peak)} | {e["serial_s"] * 1e3:.0f} / - '
        '| - |')
  lines += ['', 'The best estimates (those compiled first):', '',
            '| mesh | levers | memory GiB: auto / manual | step ms (serial) |',
            '|---|---|---:|---:|']
  for e in search.fastest_fitting(estimates, result['hbm_bytes_per_device'])[:12]:
    mesh = ' x '.join(f'{a} {n}' for a, n in e['mesh'].items() if n > 1) or 'one device'
    lines.append(f'| {mesh} | {_levers(e["lever"])} | {_gib(search.memory_of(e, "auto"))} / '
                 f'{_gib(search.memory_of(e, "manual"))} | {e["serial_s"] * 1e3:.0f} |')
  lines += ['', 'Estimates: engine/plan/search.py (memory: the train state as laid out, '
            'gradients, gathered weights, kept activations, one layer\'s working set and the '
            'head\'s logits; time: the executed FLOPs at peak plus the communication theory\'s '
            'bytes over the interconnect, and over several slices their share between slices '
            f'at {result["dcn_gb_per_s"]:g} GB/s per chip). Compiled: as engine.plan (below).', '']
  for r in sorted(compiled, key=lambda r: r.get('rank', 0)):
    if r['status'] == 'invalid':
      continue
    levers = [f'--config.{k}={v}' for k, v in r['estimate']['lever'].items()]
    command = train_command(config_arg, [*overrides, *levers], r['mesh_shape'], r['mode'],
                            ml_collections.ConfigDict(r['config']))
    lines.append(f'- rank {r.get("rank", "-")}, {r["mesh"]}, {r["mode"]}: `{command}`')
  return '\n'.join(lines) + '\n'


def _levers(lever: dict) -> str:
  """The settings a searched candidate adds, in a few words."""
  words = [lever['model.remat'].replace('dots_with_no_batch_dims_saveable', 'dots')]
  if lever['train.microbatches'] > 1:
    words.append(f'{lever["train.microbatches"]} micro-batches')
  if lever['parallelism.optimizer_sharding'] == 'zero1':
    words.append('zero1')
  if lever['model.loss_chunks'] > 1:
    words.append(f'loss in {lever["model.loss_chunks"]}')
  words += [f'{axis} over {lever[f"mesh.dcn_{axis}"]} slices' for axis in ('data', 'fsdp')
            if lever.get(f'mesh.dcn_{axis}', 1) > 1]
  return ', '.join(words)
