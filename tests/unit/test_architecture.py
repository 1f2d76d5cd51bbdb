"""The dependency rules the layout claims (README, engine/analysis/__init__.py), read from the
source: every `import` of an engine module, at module level or inside a function."""

import ast
import pathlib
import sys

ENGINE = pathlib.Path(__file__).resolve().parents[2] / 'engine'


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


# Tools' commands that are packages of their own for a short name (`python -m engine.bench`).
TOOL_COMMANDS = ('engine.bench', 'engine.plan')


def _is_tool(name: str) -> bool:
  return any(name == tool or name.startswith(tool + '.')
             for tool in ('engine.analysis', *TOOL_COMMANDS))


def test_the_core_never_imports_the_analysis_tools():
  assert set(TOOL_COMMANDS) <= set(GRAPH)
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
  assert 'engine.parallel' in GRAPH['engine.assemble']
  assert 'engine.models.ops' in GRAPH['engine.parallel.auto']
  assert 'engine.state' in GRAPH['engine.analysis.comm_theory']
  assert 'engine.models' in _reachable('engine.parallel.auto')  # Via the package __init__.


def _parameter_names() -> set[str]:
  """Every registered model's parameter paths ('blocks/w_up_DF') and their last parts."""
  import jax  # pylint: disable=g-import-not-at-top
  from engine import config as config_lib, models, sharding
  from flax import nnx
  names = set()
  for name in models.MODELS:
    model_config = config_lib.default_config().model
    model_config.name = name
    _, abstract = sharding.abstract_model(models.build(model_config, 256).create)
    for keys, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract)):
      path = [str(getattr(k, 'key', k)) for k in keys]
      names.add('/'.join(path))
      if '_' in path[-1]:  # 'w_up_DF', 'head_DV'; not generic parts such as 'scale'.
        names.add(path[-1])
  return names


def _strings(path: pathlib.Path) -> list[str]:
  """The string literals of a module, less docstrings (which may show an example flag)."""
  tree = ast.parse(path.read_text())
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                and node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)}
  return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
          and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_parameter_name_outside_the_models():
  """The engine reads parameters by logical axes and the models' own tables (ModelSpec,
  HFFormat); a parameter's name in the engine's code would break for the next model."""
  names = _parameter_names()
  assert {'blocks/w_up_DF', 'tok_embed_VD', 'head_DV'} <= names  # The check sees real names.
  found = {}
  for module, path in MODULES.items():
    if module.startswith('engine.models'):
      continue
    hits = sorted({n for s in _strings(path) for n in names if n in s})
    if hits:
      found[module] = hits
  assert not found, f'parameter names outside engine/models/: {found}'


# Every command: its module, and the module its work starts in.
COMMANDS = ('engine.main', 'engine.bench.__main__', 'engine.plan.__main__',
            'engine.generate.__main__', 'engine.evaluate.__main__', 'engine.export.__main__',
            'engine.analysis.compare', 'engine.analysis.bubble', 'engine.analysis.show_layout',
            'engine.analysis.hf_check', 'engine.sweep.__main__')
# What only the run path does (engine.assemble): validate, build a mesh or a model, compile a
# train step.
RUN_PATH_CALLS = ('validation.validate(', 'validate(config', 'make_mesh(', 'models.build(',
                  'steps.train.lower(')


def test_every_command_starts_from_the_one_run_path():
  for command in COMMANDS:
    assert 'engine.assemble' in _reachable(command) | {command}, command
  copies = {module: [call for call in RUN_PATH_CALLS if call in path.read_text()]
            for module, path in MODULES.items()
            if module not in ('engine.assemble', 'engine.validation', 'engine.mesh')}
  assert not {m: c for m, c in copies.items() if c}, copies


def test_no_module_imports_a_command():
  """A command's `__main__` defines its flags when it loads: importing it from anywhere else
  would define them twice, or in a process that runs another command."""
  mains = {name for name in GRAPH if name.endswith('.__main__')}
  assert {'engine.generate.__main__', 'engine.plan.__main__'} <= mains  # The check sees them.
  importers = {name: sorted(GRAPH[name] & mains) for name in GRAPH if GRAPH[name] & mains}
  assert not importers, importers


def test_the_training_loop_imports_the_generation_library_not_the_command():
  assert 'engine.generate.sampling' in _reachable('engine.train.loop')
  assert 'engine.generate.__main__' not in _reachable('engine.train.loop')
