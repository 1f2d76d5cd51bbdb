"""Loop trip counts read off hand-written HLO (engine.analysis.hlo), and what the collective
counter does with them: known counts multiply, unknown ones count once and are said to be lower
bounds (marked on the collective, in `summarize`, in the reports, and in one warning).

The snippets follow what XLA prints (jax 0.10.2): XLA:TPU leaves a loop's compare and step bare
and records no trip count; XLA:CPU wraps them in fusions and records `known_trip_count`. Nothing
here compiles.
"""

import logging

import pytest

from engine.analysis import benchmark, collectives, hlo, verdicts
from engine.analysis.compare import comparison
from engine.analysis.compare import report as compare_report

# A loop over (counter, data, bound): `bound` is carried from the entry's second parameter, so a
# loop compared with it has no constant bound. {start}, {step}, {update} and {compare} are the
# parts the tests vary; {body_extra} adds instructions (collectives) to the body.
_LOOP = '''HloModule loop, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}}

%body (p: (s32[], f32[128], s32[])) -> (s32[], f32[128], s32[]) {{
  %p = (s32[], f32[128]{{0}}, s32[]) parameter(0)
  %step = s32[] constant({step})
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[128]{{0}} get-tuple-element(%p), index=1
  %n = s32[] get-tuple-element(%p), index=2
  %next = s32[] {update}
{body_extra}  ROOT %out = (s32[], f32[128]{{0}}, s32[]) tuple(%next, %x, %n)
}}

%cond (p.1: (s32[], f32[128], s32[])) -> pred[] {{
  %p.1 = (s32[], f32[128]{{0}}, s32[]) parameter(0)
  %limit = s32[] constant({limit})
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %bound = s32[] get-tuple-element(%p.1), index=2
  ROOT %keep_going = pred[] {compare}
}}

ENTRY %main (x.1: f32[128], n.1: s32[]) -> f32[128] {{
  %x.1 = f32[128]{{0}} parameter(0)
  %n.1 = s32[] parameter(1)
  %start = s32[] constant({start})
  %init = (s32[], f32[128]{{0}}, s32[]) tuple(%start, %x.1, %n.1)
  %loop = (s32[], f32[128]{{0}}, s32[]) while(%init), condition=%cond, body=%body{while_attrs}
  ROOT %result = f32[128]{{0}} get-tuple-element(%loop), index=1
}}
'''

_ALL_REDUCE = ('  %ar = f32[128]{0} all-reduce(%x), channel_id=1, '
               'replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add\n')


def _loop(start=0, step=1, update='add(%i, %step)', limit=5,
          compare='compare(%i.1, %limit), direction=LT', body_extra='', while_attrs=''):
  return _LOOP.format(start=start, step=step, update=update, limit=limit, compare=compare,
                      body_extra=body_extra, while_attrs=while_attrs)


def _trips(hlo_text):
  ops, roots = hlo.parse_instructions(hlo_text)
  return hlo.trip_count(ops, roots, 'main', 'init', 'cond', 'body')


def test_counting_up_from_0_by_1_while_below_5_is_5():
  assert _trips(_loop()) == 5


def test_counting_from_2_by_3_while_at_most_20_is_7():
  # 2, 5, 8, 11, 14, 17, 20.
  assert _trips(_loop(start=2, step=3, limit=20,
                      compare='compare(%i.1, %limit), direction=LE')) == 7


def test_constant_on_the_left_of_the_compare_is_flipped():
  # 7 > i is i < 7: 7 trips (read unflipped, GT from 0 upwards would not be a count at all).
  assert _trips(_loop(limit=7, compare='compare(%limit, %i.1), direction=GT')) == 7


def test_counter_on_the_right_of_the_step_add():
  assert _trips(_loop(update='add(%step, %i)', limit=9)) == 9


@pytest.mark.parametrize('start, step, update, compare, limit, trips', [
    (10, 1, 'subtract(%i, %step)', 'compare(%i.1, %limit), direction=GT', 0, 10),  # 10 ... 1
    (10, -2, 'add(%i, %step)', 'compare(%i.1, %limit), direction=GE', 1, 5),  # 10, 8, 6, 4, 2
])
def test_counting_down(start, step, update, compare, limit, trips):
  assert _trips(_loop(start=start, step=step, update=update, limit=limit,
                      compare=compare)) == trips


def test_not_equal_compare_and_a_loop_that_never_runs():
  assert _trips(_loop(limit=4, compare='compare(%i.1, %limit), direction=NE')) == 4
  assert _trips(_loop(start=5, limit=5)) == 0


@pytest.mark.parametrize('compare, update', [
    ('compare(%i.1, %bound), direction=LT', 'add(%i, %step)'),  # Bound carried in the loop.
    ('compare(%i.1, %limit), direction=LT', 'multiply(%i, %step)'),  # Not a step.
    ('compare(%i.1, %limit), direction=GT', 'add(%i, %step)'),  # Up from 0 while above 5.
])
def test_loops_that_do_not_count_have_no_trip_count(compare, update):
  assert _trips(_loop(compare=compare, update=update, step=2)) is None


# XLA:CPU's spelling of `fori_loop(0, 5, ...)`: the compare and the step inside fusions.
_CPU_LOOP = '''HloModule jit_f, is_scheduled=true

%wrapped_add_computation (param_0.2: s32[], param_1.4: s32[]) -> s32[] {
  %param_0.2 = s32[] parameter(0)
  %param_1.4 = s32[] parameter(1)
  ROOT %add.24 = s32[] add(%param_0.2, %param_1.4), metadata={op_name="jit(f)/while/body/add"}
}

%region_0.2 (arg_tuple.6: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg_tuple.6 = (s32[], f32[4]{0}) parameter(0)
  %constant.15 = s32[] constant(1)
  %get-tuple-element.42 = f32[4]{0} get-tuple-element(%arg_tuple.6), index=1
  %get-tuple-element.41 = s32[] get-tuple-element(%arg_tuple.6), index=0
  %copy.2 = s32[] copy(%get-tuple-element.41)
  %wrapped_add = s32[] fusion(%copy.2, %constant.15), kind=kLoop, calls=%wrapped_add_computation
  ROOT %tuple.14 = (s32[], f32[4]{0}) tuple(%wrapped_add, %get-tuple-element.42)
}

%wrapped_compare_computation (param_0.3: s32[], param_1.5: s32[]) -> pred[] {
  %param_0.3 = s32[] parameter(0)
  %param_1.5 = s32[] parameter(1)
  ROOT %lt.3 = pred[] compare(%param_0.3, %param_1.5), direction=LT
}

%region_1.3 (arg_tuple.5: (s32[], f32[4])) -> pred[] {
  %arg_tuple.5 = (s32[], f32[4]{0}) parameter(0)
  %constant.14 = s32[] constant(5)
  %get-tuple-element.32 = s32[] get-tuple-element(%arg_tuple.5), index=0
  ROOT %wrapped_compare = pred[] fusion(%get-tuple-element.32, %constant.14), kind=kLoop, calls=%wrapped_compare_computation
}

ENTRY %main.4 (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0), metadata={op_name="x"}
  %constant.9 = s32[] constant(0)
  %copy.6 = f32[4]{0} copy(%x.1)
  %copy.7 = s32[] copy(%constant.9)
  %tuple.12 = (s32[], f32[4]{0}) tuple(%copy.7, %copy.6)
  %while.2 = (s32[], f32[4]{0}) while(%tuple.12), condition=%region_1.3, body=%region_0.2
  ROOT %while.9 = f32[4]{0} get-tuple-element(%while.2), index=1
}
'''


def test_compare_and_step_inside_fusions_are_read_through():
  ops, roots = hlo.parse_instructions(_CPU_LOOP)
  assert hlo.trip_count(ops, roots, 'main.4', 'tuple.12', 'region_1.3', 'region_0.2') == 5


class _Mesh:
  def __init__(self, shape):
    self.shape = shape


MESH = _Mesh({'data': 8})
_UNREADABLE = 'compare(%i.1, %bound), direction=LT'


def _warnings(caplog):
  return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_known_trip_count_is_used_even_where_the_loop_cannot_be_read(caplog):
  hlo = _loop(compare=_UNREADABLE, body_extra=_ALL_REDUCE,
              while_attrs=', backend_config={"known_trip_count":{"n":"6"}}')
  with caplog.at_level(logging.WARNING):
    (found,) = collectives.count_collectives(hlo, MESH)
  assert (found.kind, found.axes, found.executions) == ('all-reduce', ('data',), 6)
  assert found.trip_count_known and found.unknown_trip_loops == ()
  assert _warnings(caplog) == []


def test_trip_count_read_off_a_loop_without_a_recorded_one(caplog):
  # XLA:TPU records no trip count: 2, 5, ..., 20 read off the loop, 7 all-reduces.
  hlo = _loop(start=2, step=3, limit=20, compare='compare(%i.1, %limit), direction=LE',
              body_extra=_ALL_REDUCE)
  with caplog.at_level(logging.WARNING):
    found = collectives.count_collectives(hlo, MESH)
  assert [(c.executions, c.trip_count_known) for c in found] == [(7, True)]
  row = collectives.summarize(found)[('all-reduce', ('data',))]
  assert row['executions'] == 7 and row['bytes'] == 7 * 512 and row['ops_in_unknown_loops'] == 0
  assert _warnings(caplog) == []


def test_unreadable_loop_counts_once_and_says_so(caplog):
  second = _ALL_REDUCE.replace('%ar =', '%ar.2 =').replace('channel_id=1', 'channel_id=2')
  hlo = _loop(compare=_UNREADABLE, body_extra=_ALL_REDUCE + second)
  hlo = hlo.replace('  ROOT %result', '  %outside = f32[128]{0} all-gather(%x.1), '
                    'replica_groups=[1,8]<=[8], dimensions={0}\n  ROOT %result')
  with caplog.at_level(logging.WARNING):
    found = collectives.count_collectives(hlo, MESH)
  inside = [c for c in found if c.kind == 'all-reduce']
  assert [(c.name, c.executions, c.unknown_trip_loops) for c in inside] == [
      ('ar', 1, ('body',)), ('ar.2', 1, ('body',))]
  assert not any(c.trip_count_known for c in inside)
  (outside,) = [c for c in found if c.kind == 'all-gather']
  assert outside.trip_count_known and outside.executions == 1
  table = collectives.summarize(found)
  assert table[('all-reduce', ('data',))]['ops_in_unknown_loops'] == 2
  assert table[('all-reduce', ('data',))]['executions'] == 2  # Once each: a lower bound.
  assert table[('all-gather', ('data',))]['ops_in_unknown_loops'] == 0
  (warning,) = _warnings(caplog)  # One per count, however many collectives the loop holds.
  assert 'body: body)' in warning and 'lower bounds' in warning


def test_known_loop_inside_an_unknown_one_is_marked_with_the_outer_loop(caplog):
  # XLA:CPU puts a loop in a computation of its own, called: the mark goes through the call.
  hlo = '\n'.join([
      '%inner (q: (s32[], f32[8])) -> (s32[], f32[8]) {',
      '  %q = (s32[], f32[8]{0}) parameter(0)',
      '  %y = f32[8]{0} get-tuple-element(%q), index=1',
      '  %ag = f32[64]{0} all-gather(%y), replica_groups=[1,8]<=[8], dimensions={0}',
      '}',
      '%inner_loop (s: (s32[], f32[8])) -> (s32[], f32[8]) {',
      '  %s = (s32[], f32[8]{0}) parameter(0)',
      '  ROOT %w.1 = (s32[], f32[8]{0}) while(%s), condition=%inner_cond, body=%inner, '
      'backend_config={"known_trip_count":{"n":"4"}}',
      '}',
      '%outer (r: (s32[], f32[8])) -> (s32[], f32[8]) {',
      '  %r = (s32[], f32[8]{0}) parameter(0)',
      '  ROOT %c = (s32[], f32[8]{0}) call(%r), to_apply=%inner_loop',
      '}',
      'ENTRY %main (t: (s32[], f32[8])) -> (s32[], f32[8]) {',
      '  %t = (s32[], f32[8]{0}) parameter(0)',
      '  ROOT %w = (s32[], f32[8]{0}) while(%t), condition=%outer_cond, body=%outer',
      '}'])
  with caplog.at_level(logging.WARNING):
    (found,) = collectives.count_collectives(hlo, MESH)
  assert (found.executions, found.unknown_trip_loops) == (4, ('outer',))
  (warning,) = _warnings(caplog)
  assert 'body: outer)' in warning and 'inner' not in warning


class _Run:
  def __init__(self, mode, found):
    self.mode, self.collectives = mode, found


def _unknown_and_known_runs():
  known = collectives.count_collectives(_loop(body_extra=_ALL_REDUCE), MESH)
  unknown = collectives.count_collectives(
      _loop(compare=_UNREADABLE, body_extra=_ALL_REDUCE), MESH)
  return [_Run('auto', known), _Run('manual', unknown)]


def test_reports_mark_lower_bounds():
  runs = _unknown_and_known_runs()
  theory = {('all-reduce', ('data',)): 5 * 512}
  (row,) = verdicts.communication_table(runs, theory)
  assert row['auto'] == {'executions': 5, 'bytes': 5 * 512, 'ratio': 1.0, 'unexpected': False,
                         'lower_bound': False, 'dtype_bytes': {'f32': 5 * 512}}
  assert row['manual']['executions'] == 1 and row['manual']['lower_bound']

  report = {'mesh': {'data': 8}, 'modes': ['auto', 'manual'], 'steps': 1, 'warmup': 0,
            'timed_steps': 1, 'tokens_per_step': 16, 'losses': {'auto': [1.0], 'manual': [1.0]},
            'speed': {m: {'compile_s': 1, 'median_ms': 1, 'min_ms': 1, 'max_ms': 1,
                          'tokens_per_s': 1} for m in ('auto', 'manual')},
            'memory': {'auto': {}, 'manual': {}}, 'communication': [row]}
  text = compare_report.markdown(report)
  cells = next(line for line in text.splitlines() if line.startswith('| all-reduce'))
  assert cells == ("| all-reduce | data | 2.5 | 5 | 2.5 | f32 100 % | 1.00 | >= 1 (a loop's "
                   "trip count unknown) | >= 0.5 | f32 100 % | **>= 0.20** |")
  assert '**Lower bounds** (manual: all-reduce over data).' in text

  rows = [{'collectives': [{'kind': k, 'axes': list(a), **r} for (k, a), r in
                           collectives.summarize(run.collectives).items()]} for run in runs]
  assert benchmark._collectives_cell(rows[0]['collectives']) == (
      'all-reduce data: 5x, 0.0 MiB (f32 100 %)')
  assert benchmark._collectives_cell(rows[1]['collectives']) == (
      'all-reduce data: >= 1x, >= 0.0 MiB (f32 100 %)')


def test_plan_report_marks_lower_bounds():
  from engine.plan import report as plan_report  # pylint: disable=import-outside-toplevel
  runs = _unknown_and_known_runs()
  config = {'model': {'name': 'gpt', 'num_layers': 2, 'embed_dim': 32, 'dtype': 'float32',
                      'remat': 'none'},
            'data': {'seq_len': 16, 'global_batch_size': 16},
            'mesh': {'data': 8, 'fsdp': 1, 'tensor': 1, 'context': 1, 'stage': 1, 'expert': 1,
                     'dcn_data': 1, 'dcn_fsdp': 1}}
  candidates = []
  for rank, run in enumerate(runs, 1):
    (communication,) = verdicts.communication_table(
        [run], {('all-reduce', ('data',)): 5 * 512})
    candidates.append({
        'rank': rank, 'mode': run.mode, 'mesh': 'data 8', 'mesh_shape': config['mesh'],
        'status': 'fits', 'config': config, 'memory': {}, 'compile_s': 1.0,
        'communication': [communication]})
  result = {'topology': 'v5p:2x2x2', 'num_slices': 1, 'devices': 8, 'chip': 'TPU v5p',
            'hbm_bytes_per_device': 2**30, 'candidates': candidates}
  text = plan_report.markdown(result, 'experiments/tiny.py')
  rows = [line for line in text.splitlines() if line.startswith('| all-reduce')]
  assert rows == ['| all-reduce | data | 5 | 0.0 | f32 100 % | 0.0 | 1.00 |',
                  "| all-reduce | data | >= 1 (a loop's trip count unknown) | >= 0.0 | f32 100 % | "
                  '0.0 | **>= 0.20** |']
  assert text.count('**Lower bounds**') == 1
