"""The matrix products of a compiled program, by operand types: what `engine.plan` reports to
show that int8 / fp8 projections reached the chip's int8 / fp8 units (XLA:TPU writes dots as
convolutions and prints their operands by name, so types are looked up by instruction)."""

from __future__ import annotations

import collections
import re

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
