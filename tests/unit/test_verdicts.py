"""The verdicts that head the reports: which collectives are off their theory, and why."""

from engine.analysis import verdicts


def _row(kind, axes, theory, **modes):
  row = {'kind': kind, 'axes': axes, 'theory_bytes': theory}
  for mode, measured in modes.items():
    row[mode] = {'executions': 1, 'bytes': measured,
                 'ratio': measured / theory if theory else None,
                 'unexpected': not theory and measured > 0, 'lower_bound': False}
  return row


CPU = verdicts.Context('cpu')


def test_rows_within_a_tenth_of_their_theory_are_not_flagged():
  rows = [_row('all-reduce', 'data', 1000, auto=1090, manual=910)]
  assert verdicts.off_theory(rows, ['auto', 'manual'], CPU) == []
  assert 'Every collective is within [0.9, 1.1]' in '\n'.join(verdicts.markdown([]))


def test_manual_off_its_theory_is_unexplained_and_comes_first():
  rows = [_row('all-reduce', 'fsdp', 100, auto=204_900, manual=100),
          _row('all-gather', 'fsdp', 3126, auto=3126, manual=1588),
          _row('all-to-all', 'expert', 0, auto=0, manual=64)]
  flags = verdicts.off_theory(rows, ['auto', 'manual'], CPU)
  assert [(f.mode, f.kind, f.explained) for f in flags] == [
      ('manual', 'all-gather', False), ('manual', 'all-to-all', False),
      ('auto', 'all-reduce', True)]
  assert flags[0].describe() == 'manual: all-gather over fsdp at 0.51x its theory'
  assert flags[1].describe() == 'manual: all-to-all over expert, not in the theory'
  assert "SPMD partitioner" in flags[2].reason
  text = '\n'.join(verdicts.markdown(flags))
  assert '3 row(s) outside [0.9, 1.1] of the theory or not in it, 2 unexplained' in text
  assert text.index('UNEXPLAINED** manual: all-gather') < text.index('auto: all-reduce')


def test_a_lower_bound_below_its_theory_is_explained_by_the_unknown_trip_count():
  row = _row('all-gather', 'fsdp', 1000, manual=500)
  row['manual']['lower_bound'] = True
  [flag] = verdicts.off_theory([row], ['manual'], CPU)
  assert flag.reason == verdicts.LOWER_BOUND


def test_the_cpu_merge_explains_only_the_bytes_it_predicts():
  """Written-out layers on XLA:CPU: the gather is explained where it matches the prediction
  without re-gathers, and not where it does not, nor on TPU, nor with scanned layers."""
  merged = verdicts.Context('cpu', scan_layers=False, merged_gather_bytes={'fsdp': 1600},
                            layers=4)
  row = _row('all-gather', 'fsdp', 3200, manual=1600)
  [flag] = verdicts.off_theory([row], ['manual'], merged)
  assert flag.explained
  assert f'{3 * 400 / 2**20:.2f} MiB' in flag.reason  # Three layers' gathers kept too long.
  for context in (verdicts.Context('tpu', False, {'fsdp': 1600}, 4),
                  verdicts.Context('cpu', True, {'fsdp': 1600}, 4)):
    assert not verdicts.off_theory([row], ['manual'], context)[0].explained
  other = _row('all-gather', 'fsdp', 3200, manual=800)
  assert not verdicts.off_theory([other], ['manual'], merged)[0].explained


def test_warnings_name_the_unexplained_rows(caplog):
  flags = verdicts.off_theory([_row('all-gather', 'fsdp', 3126, manual=1588)], ['manual'], CPU)
  with caplog.at_level('INFO'):
    verdicts.log(flags)
  assert [r.levelname for r in caplog.records] == ['WARNING']
  assert 'UNEXPLAINED: manual: all-gather over fsdp at 0.51x' in caplog.text


def test_the_8b_plans_gathers_and_embedding_reduction_are_explained():
  """The rows of a Llama-8B plan on TPU (data 8 x fsdp 16, manual, MiB): gathers in bfloat16
  under float32 reductions, and the embedding's gradient all-reduced instead of scattered."""
  mib = 2**20
  rows = [_row('all-gather', 'fsdp', 57256 * mib, manual=28628 * mib),
          _row('all-reduce', 'fsdp', 0, manual=2004 * mib),
          _row('reduce-scatter', 'fsdp', 1914.5 * mib, manual=1789.2 * mib)]
  tpu = verdicts.Context('tpu', gather_cast_ratio=0.5, axis_sizes={'data': 8, 'fsdp': 16})
  flags = verdicts.off_theory(rows, ['manual'], tpu)
  assert [f.kind for f in flags] == ['all-gather', 'all-reduce'] and all(f.explained for f in flags)
  assert 'the dtype its matmuls read' in flags[0].reason and 'times 16' in flags[1].reason
  # Under float32 compute the same half-size gathers have no such excuse.
  assert not verdicts.off_theory(rows[:1], ['manual'], verdicts.Context('tpu'))[0].explained
