"""The dependency rules the layout claims (README, engine/analysis/__init__.py), read from the
source: every `import` of an engine module, at module level or inside a function."""

import ast
import importlib.util
import io
import pathlib
import re
import sys
import tokenize

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


# The engine's floors, bottom up: a module imports only from its own floor or those below.
# Within a floor, packages import one way too (test_the_packages_import_one_way).
FLOORS = (
    # What everything reads: the errors, the schema, the command line, the models.
    ('engine', 'engine.errors', 'engine.config', 'engine.chips', 'engine.runtime', 'engine.cli',
     'engine.mesh', 'engine.models'),
    # The parts a run is built from.
    ('engine.optimizer', 'engine.muon', 'engine.sharding', 'engine.state', 'engine.parallel',
     'engine.data', 'engine.hf', 'engine.distributed', 'engine.workdir', 'engine.loggers',
     'engine.validation'),
    # The one run path.
    ('engine.assemble',),
    # What runs on an assembled run: training, generation, evaluation, export.
    ('engine.generate', 'engine.train', 'engine.evaluate', 'engine.export'),
    # The training command and the tools.
    ('engine.main', 'engine.bench', 'engine.plan', 'engine.sweep', 'engine.analysis',
     'engine.lm_eval'),
)


def _unit(module: str) -> str:
  """A module's package below engine/ ('engine.data'), or its own name at the top level."""
  return '.'.join(module.split('.')[:2])


def _floor(unit: str) -> int:
  return next(i for i, floor in enumerate(FLOORS) if unit in floor)


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
  return sorted(f'{name} imports {child}' for name, children in graph.items()
                for child in children if _floor(_unit(child)) > _floor(_unit(name)))


def test_every_package_has_a_floor():
  units = {_unit(name) for name in GRAPH}
  placed = {unit for floor in FLOORS for unit in floor}
  assert units == placed, f'unplaced: {units - placed}; gone: {placed - units}'


def test_no_module_imports_from_a_floor_above_its_own():
  assert not _upward_imports(GRAPH)
  planted = {**GRAPH, 'engine.data.sources': GRAPH['engine.data.sources'] | {'engine.assemble'}}
  assert _upward_imports(planted) == ['engine.data.sources imports engine.assemble']


def test_the_packages_import_one_way():
  """No two packages import each other, even through others (modules may; packages may not)."""
  edges = {}
  for name, children in GRAPH.items():
    edges.setdefault(_unit(name), set()).update(_unit(c) for c in children)
  for unit in edges:
    edges[unit].discard(unit)

  def reachable(start):
    seen, todo = set(), [start]
    while todo:
      for child in edges.get(todo.pop(), ()):
        if child not in seen:
          seen.add(child)
          todo.append(child)
    return seen

  assert 'engine.state' in reachable('engine.assemble')  # The check sees real edges.
  cycles = sorted(unit for unit in edges if unit in reachable(unit))
  assert not cycles, f'packages that import themselves through others: {cycles}'


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
            'engine.analysis.compare.__main__', 'engine.analysis.bubble.__main__',
            'engine.analysis.show_layout.__main__', 'engine.analysis.hf_check.__main__',
            'engine.sweep.__main__')
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


# Flags are defined one way: at module level of a command module (engine/main.py, a __main__.py,
# or a module run as __main__ that no engine module imports). A flag defined when a library is
# imported, or inside a function, would clash with another command's flag of that name in a
# process that imports both, or be defined twice. The one exception: the definers of the flags
# several commands share, in engine/cli/ (add_bos_flag), which commands call at module level.
_GUARD = "__name__ == '__main__'"


def _trees() -> dict[str, ast.Module]:
  return {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _definers(trees: dict[str, ast.Module]) -> set[str]:
  """The functions of engine/cli/ that define a flag when called."""
  return {node.name for name, tree in trees.items() if name.startswith('engine.cli')
          for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
          and any(_defines(call, set()) for call in ast.walk(node) if isinstance(call, ast.Call))}


def _defines(call: ast.Call, definers: set[str]) -> bool:
  name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, 'id', '')
  return name.startswith('DEFINE_') or name in definers


def _flag_definitions(tree: ast.Module, definers: set[str]) -> list[tuple[int, str | None]]:
  """(line, the function or class it is in; None at module level) of each flag definition."""
  found = []

  def visit(node: ast.AST, inside: str | None) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.Call) and _defines(child, definers):
        found.append((child.lineno, inside))
      scope = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
      visit(child, getattr(child, 'name', '<lambda>') if scope else inside)

  visit(tree, None)
  return found


def _command_modules(trees: dict[str, ast.Module], graph: dict[str, set[str]]) -> set[str]:
  imported = set().union(*graph.values())
  runs_as_main = {name for name, tree in trees.items() if any(
      isinstance(node, ast.If) and ast.unparse(node.test) == _GUARD for node in tree.body)}
  named = {name for name in trees if name == 'engine.main' or name.endswith('.__main__')}
  return named | (runs_as_main - imported)


def _misplaced_flags(trees: dict[str, ast.Module], graph: dict[str, set[str]]) -> list[str]:
  definers = _definers(trees)
  commands = _command_modules(trees, graph)
  imported = set().union(*graph.values())
  wrong = []
  for name, tree in trees.items():
    for line, inside in _flag_definitions(tree, definers):
      if inside is not None and not (name.startswith('engine.cli') and inside in definers):
        wrong.append(f'{name}:{line} defines a flag inside {inside}')
      elif inside is None and name not in commands:
        wrong.append(f'{name}:{line} defines a flag, but is not a command module')
      elif inside is None and name in imported:
        wrong.append(f'{name}:{line} defines a flag, and engine modules import it')
  return wrong


def test_flags_are_defined_at_module_level_of_command_modules_only():
  trees = _trees()
  commands = _command_modules(trees, GRAPH)
  # The check sees the commands of each kind, and not their libraries.
  assert {'engine.main', 'engine.sweep.__main__', 'engine.analysis.compare.__main__',
          'engine.data.prepare'} <= commands
  assert not {'engine.analysis.compare.comparison', 'engine.data.shard_writer'} & commands
  assert 'add_bos_flag' in _definers(trees)
  assert not _misplaced_flags(trees, GRAPH)


def test_the_flag_check_finds_planted_definitions():
  trees, graph = _trees(), dict(GRAPH)
  planted = {
      'engine.analysis.planted_library': (
          'from absl import flags\n\ndef main():\n  flags.DEFINE_string("x", None, "")\n'),
      'engine.analysis.planted_import': 'from absl import flags\nflags.DEFINE_bool("y", 1, "")\n',
      'engine.analysis.planted_command': (
          'from engine.cli.command_line import add_bos_flag\n_BOS = add_bos_flag()\n'
          'if __name__ == \'__main__\':\n  pass\n'),
      'engine.analysis.planted_shared': (
          'from engine.cli.command_line import add_bos_flag\n\nclass A:\n  B = add_bos_flag()\n'),
  }
  trees.update({name: ast.parse(text) for name, text in planted.items()})
  graph.update({name: set() for name in planted})
  wrong = _misplaced_flags(trees, graph)
  assert wrong == ['engine.analysis.planted_library:4 defines a flag inside main',
                   'engine.analysis.planted_import:2 defines a flag, but is not a command module',
                   'engine.analysis.planted_shared:4 defines a flag inside A']
  # A command module that an engine module imports is no longer a command.
  graph['engine.analysis.planted_import'] = {'engine.analysis.planted_command'}
  assert ('engine.analysis.planted_command:2 defines a flag, but is not a command module'
          in _misplaced_flags(trees, graph))
  graph['engine.analysis.planted_import'] = {'engine.main'}
  assert ('engine.main:' in ' '.join(_misplaced_flags(trees, graph))
          and 'engine modules import it' in ' '.join(_misplaced_flags(trees, graph)))


def test_the_forked_command_runner_imports_no_command_module():
  """tests/support/forked_commands.py runs each command as __main__ in a child of a process that has
  imported the commands' libraries: had it imported a command module, the flags would be defined
  twice."""
  path = pathlib.Path(importlib.util.find_spec('tests.support.forked_commands').origin)
  imported = _imports(path)
  assert {'engine.assemble', 'engine.data.shard_writer'} <= imported  # The check sees them.
  assert not imported & _command_modules(_trees(), GRAPH), imported


# A path of the repository as docs name it: engine/x/y.py or engine/x/ (a folder).
_ENGINE_PATH = re.compile(r'(?<![\w/.-])engine/(?:[A-Za-z_]\w*/)*(?:[A-Za-z_]\w*\.py|[A-Za-z_]\w*/)')


def _docstrings_and_comments(path: pathlib.Path) -> list[str]:
  """The prose of a module: its docstrings (module, classes, functions) and comments."""
  source = path.read_text()
  texts = [ast.get_docstring(node) or '' for node in ast.walk(ast.parse(source))
           if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
  return texts + [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
                  if token.type == tokenize.COMMENT]


def test_every_package_docstring_maps_its_modules():
  """A reader finds a module from its package's docstring: every module file is named there."""
  unmapped = {}
  for init in sorted(ENGINE.rglob('__init__.py')):
    doc = ast.get_docstring(ast.parse(init.read_text())) or ''
    missing = [p.name for p in sorted(init.parent.glob('*.py'))
               if p.name != '__init__.py' and not re.search(rf'(?<![\w/]){re.escape(p.name)}', doc)]
    if missing:
      unmapped[str(init.relative_to(ENGINE.parent))] = missing
  assert 'engine/generate/__main__.py' in {str(p.relative_to(ENGINE.parent))
                                           for p in ENGINE.rglob('*.py')}  # The check sees them.
  assert not unmapped, f'modules their package\'s __init__ docstring does not name: {unmapped}'


def test_every_named_engine_path_exists():
  """Paths in the engine's docstrings and comments, the README and docs/*.md name real files."""
  root = ENGINE.parent
  sources = [(p, text) for p in sorted(ENGINE.rglob('*.py')) for text in _docstrings_and_comments(p)]
  sources += [(p, p.read_text()) for p in [root / 'README.md', *sorted((root / 'docs').glob('*.md'))]]
  named = {(str(p.relative_to(root)), m) for p, text in sources for m in _ENGINE_PATH.findall(text)}
  assert len(named) > 50  # The pattern finds the paths the docs name.
  missing = sorted((where, m) for where, m in named if not (root / m).exists())
  assert not missing, f'named paths that do not exist (file, path): {missing}'
