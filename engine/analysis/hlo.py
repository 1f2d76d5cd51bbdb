"""Readers of compiled HLO text: the trip counts of its `while` loops, read off the loops
themselves, and its matrix products by operand types.

XLA:CPU records `known_trip_count` on each loop; XLA:TPU does not. A loop that counts (a counter
set to a constant before the loop, stepped by a constant in the body, compared with a constant
in the condition) has its count recovered here, for the collective counter
(engine.analysis.collectives). Any other loop gets None: the counter then counts its body once,
as a lower bound, and marks and reports it as such.

`matmul_types` is what `engine.plan` reports to show that int8 / fp8 projections reached the
chip's int8 / fp8 units (XLA:TPU writes dots as convolutions and prints their operands by name,
so types are looked up by instruction).
"""

from __future__ import annotations

import collections
import dataclasses
import re

# The header line of an HLO computation: its name.
COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) \(.*\{$')
_ANY = re.compile(r'^\s*(ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$')


@dataclasses.dataclass(frozen=True)
class _Op:
  op: str
  operands: tuple[str, ...]
  literal: str  # What the brackets hold for a constant or parameter: its value, its number.
  attrs: str  # Everything after the brackets.


def _split_call(rest: str) -> tuple[str, str]:
  """'a, b), attr=...' -> ('a, b', ', attr=...'): the operand list up to its closing bracket."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(ch, 0)
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ''


def parse_instructions(hlo_text: str) -> tuple[dict[str, dict[str, _Op]], dict[str, str]]:
  """computation -> {instruction -> _Op}, and computation -> its ROOT instruction."""
  ops, roots, current = collections.defaultdict(dict), {}, None
  for line in hlo_text.splitlines():
    if m := COMPUTATION.match(line):
      current = m.group(1)
    elif current and (m := _ANY.match(line)):
      root, name, _, op, rest = m.groups()
      inside, after = _split_call(rest)
      literal = op in ('constant', 'parameter')
      ops[current][name] = _Op(op, () if literal else tuple(re.findall(r'%([\w.\-]+)', inside)),
                               inside.strip() if literal else '', after)
      if root:
        roots[current] = name
  return ops, roots


_FLIP = {'LT': 'GT', 'GT': 'LT', 'LE': 'GE', 'GE': 'LE', 'NE': 'NE', 'EQ': 'EQ'}


def _expr(ops, roots, comp, name, bind=None, depth=0):
  """(op, operands' values, attrs) of an instruction, looking through a fusion's wrapper: XLA:CPU
  hides the loop's compare and step inside fusions."""
  op = ops[comp].get(name)
  if op is None or depth > 8:
    return None
  if op.op == 'fusion' and (callee := re.search(r'calls=%?([\w.\-]+)', op.attrs)):
    callee = callee.group(1)
    inner = {i: (comp, o, bind) for i, o in enumerate(op.operands)}
    return _expr(ops, roots, callee, roots.get(callee, ''), inner, depth + 1)
  return op.op, [_value(ops, comp, o, bind, depth + 1) for o in op.operands], op.attrs


def _value(ops, comp, name, bind=None, depth=0):
  """('const', n), ('index', k) for element k of the loop computation's parameter, or None: the
  only operands a countable loop's compare and step may have."""
  op = ops[comp].get(name)
  if op is None or depth > 16:
    return None
  if op.op == 'constant':
    return ('const', int(op.literal)) if re.fullmatch(r'-?\d+', op.literal) else None
  if op.op == 'parameter' and bind is not None:
    outer = bind.get(int(op.literal)) if op.literal.isdigit() else None
    return _value(ops, *outer, depth + 1) if outer else None
  if op.op in ('copy', 'convert', 'bitcast', 'reshape') and op.operands:
    return _value(ops, comp, op.operands[0], bind, depth + 1)
  if op.op == 'get-tuple-element' and op.operands and bind is None:
    source = ops[comp].get(op.operands[0])
    index = re.search(r'index=(\d+)', op.attrs)
    if source is not None and source.op == 'parameter' and index:
      return ('index', int(index.group(1)))
  return None


def _loop_test(ops, roots, cond: str) -> tuple[int, int, str] | None:
  """(counter's tuple index, constant limit, direction) of the condition's compare, written as
  `counter <direction> limit`; None when the condition is no such compare."""
  compare = _expr(ops, roots, cond, roots.get(cond, ''))
  direction = re.search(r'direction=(\w+)', compare[2]) if compare else None
  if not direction or compare[0] != 'compare' or len(compare[1]) != 2:
    return None
  (lhs, rhs), direction = compare[1], direction.group(1)
  if lhs and rhs and lhs[0] == 'const' and rhs[0] == 'index':
    lhs, rhs, direction = rhs, lhs, _FLIP[direction]
  if not (lhs and rhs and lhs[0] == 'index' and rhs[0] == 'const'):
    return None
  return lhs[1], rhs[1], direction


def _counter_start_step(ops, roots, caller: str, init: str, body: str,
                        index: int) -> tuple[int, int] | None:
  """(start, step) of the counter at `index`: a constant in the loop's initial tuple and a
  constant added or subtracted in the body; None when either is not."""
  start_tuple = ops[caller].get(init)
  body_tuple = ops[body].get(roots.get(body, ''))
  if (start_tuple is None or start_tuple.op != 'tuple' or body_tuple is None
      or body_tuple.op != 'tuple' or index >= min(len(start_tuple.operands),
                                                  len(body_tuple.operands))):
    return None
  start = _value(ops, caller, start_tuple.operands[index])
  update = _expr(ops, roots, body, body_tuple.operands[index])
  if not (start and start[0] == 'const' and update and update[0] in ('add', 'subtract')
          and len(update[1]) == 2):
    return None
  terms = update[1]
  if update[0] == 'add' and terms[1] == ('index', index):
    terms = terms[::-1]
  if terms[0] != ('index', index) or not terms[1] or terms[1][0] != 'const':
    return None
  return start[1], terms[1][1] * (-1 if update[0] == 'subtract' else 1)


def _iterations(start: int, limit: int, step: int, direction: str) -> int | None:
  """How often `counter <direction> limit` holds as the counter goes from start by step; None
  when it need not end (or ends only by overflow)."""
  if direction in ('GT', 'GE'):  # Counting down: mirror it.
    start, limit, step, direction = -start, -limit, -step, {'GT': 'LT', 'GE': 'LE'}[direction]
  if direction == 'LE':
    limit, direction = limit + 1, 'LT'
  if direction == 'LT' and step > 0:
    return max(0, -(-(limit - start) // step))
  if direction == 'NE' and step and (limit - start) % step == 0 and (limit - start) // step >= 0:
    return (limit - start) // step
  return None


def trip_count(ops, roots, caller: str, init: str, cond: str, body: str) -> int | None:
  """Iterations of `while(init), condition=cond, body=body` called from `caller`, when its
  counter starts at a constant, moves by a constant step and is compared with a constant
  (XLA:CPU wraps the compare and the step in fusions; XLA:TPU leaves them bare); None when the
  loop is not of that form (the caller must not guess a count for it)."""
  test = _loop_test(ops, roots, cond)
  if test is None:
    return None
  index, limit, direction = test
  counter = _counter_start_step(ops, roots, caller, init, body, index)
  if counter is None:
    return None
  start, step = counter
  return _iterations(start, limit, step, direction)


# `%fusion.1 = s8[256,512]{1,0:T(8,128)(4,1)} fusion(...)`: an instruction's name and type.
_DEFINITION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[', re.MULTILINE)
# `%convolution.1 = s32[256,256]{...} convolution(%fusion.1, %fusion.2), ...`
_MATMUL = re.compile(r'\s(?:dot|convolution)\(%?([\w.\-]+), %?([\w.\-]+)\)')


def matmul_types(hlo_text: str) -> dict[str, int]:
  """How many matmuls (dots, and the convolutions XLA:TPU writes them as) of the compiled
  program take each pair of operand types, e.g. {'s8 x s8': 12, 'bf16 x bf16': 40}."""
  types = dict(_DEFINITION.findall(hlo_text))
  found = collections.Counter(f'{types.get(a, "?")} x {types.get(b, "?")}'
                              for a, b in _MATMUL.findall(hlo_text))
  return dict(sorted(found.items()))
