"""The dependency rules the layout claims (README, engine/analysis/__init__.py), read from the
source: every `import` of an engine module, at module level or inside a function."""

import ast
import pathlib
import sys

ENGINE = pathlib.Path(__file__).resolve().parent.parent / 'engine'


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ENGINE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {_module_name(p): p for p in ENGINE.rglob('*.py')}


def _imports(path: pathlib.Path) -> set[str]:
  """Engine modules that loading `path` executes: each imported module and its packages (but
  not a package that contains `path`: that one is already loading)."""
  own_packages = set()
  name = _module_name(path)
  while name:
    own_packages.add(name)
    name = name.rpartition('.')[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from engine import models` names a module; `from engine.x import y` an attribute.
      names = [node.module] + [f'{node.module}.{alias.name}' for alias in node.names]
    else:
      continue
    for name in names:
      while name:
        if name in MODULES:
          found.add(name)
        name = name.rpartition('.')[0]
  return found - own_packages


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _reachable(start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for child in GRAPH[todo.pop()]:
      if child not in seen:
        seen.add(child)
        todo.append(child)
  return seen


def test_the_import_graph_has_no_cycles():
  cycles = sorted(name for name in GRAPH if name in _reachable(name))
  assert not cycles, f'modules that import themselves through others: {cycles}'


def test_models_depend_on_nothing_but_models():
  for name in GRAPH:
    if name.startswith('engine.models'):
      outside = {m for m in _reachable(name) if not m.startswith('engine.models')}
      assert not outside, f'{name} depends on {outside}'


# Tools' commands that live at the top of the package for a short name (`python -m engine.bench`).
TOOL_COMMANDS = {'engine.bench', 'engine.plan'}


def _is_tool(name: str) -> bool:
  return name.startswith('engine.analysis') or name in TOOL_COMMANDS


def test_the_core_never_imports_the_analysis_tools():
  assert TOOL_COMMANDS <= set(GRAPH)
  for name in GRAPH:
    if not _is_tool(name):
      tools = {m for m in _reachable(name) if _is_tool(m)}
      assert not tools, f'{name} depends on {tools}'


def test_no_module_shadows_the_standard_library():
  shadowing = sorted(str(p.relative_to(ENGINE.parent)) for p in MODULES.values()
                     if p.stem in sys.stdlib_module_names)
  assert not shadowing, shadowing


def test_the_rules_above_hold_of_a_real_graph():
  # The parser sees the edges that matter, so the tests above can fail.
  assert 'engine.parallel' in GRAPH['engine.train']
  assert 'engine.models.ops' in GRAPH['engine.parallel.auto']
  assert 'engine.state' in GRAPH['engine.analysis.comm_theory']
  assert 'engine.models' in _reachable('engine.parallel.auto')  # Via the package __init__.
