"""The rooms of the package import only downwards (docs/architecture.md)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Rank of each room: a module may import its own room and lower ranks.
# `data` stands alone: it imports nothing from kda_lm (the library reads
# its settings, never the other way round). `testbed` (what the tests and
# the experiments measure with) sits above the library, which never
# imports it.
RANKS = {
    "data": -1,
    "kda_lm.segments": 0, "kda_lm.logs": 0,
    "kda_lm.ops": 1,
    "kda_lm.parallel": 2,
    "kda_lm.layers": 3,
    "kda_lm.config": 4, "kda_lm.stack": 4.5,
    "kda_lm.model": 5, "kda_lm.losses": 5, "kda_lm.optimizer": 5,
    "kda_lm.flops": 5.5,
    "kda_lm.checkpoint": 7,
    # The train state and its builder: the one module of the training
    # room that inference and the Hugging Face import may import.
    "kda_lm.train.state": 7.5,
    "kda_lm.train": 8, "kda_lm.infer": 8, "kda_lm.hf": 8,
    "testbed": 9,
}
# The top-level folders whose modules have a room.
ROOM_TOPS = ("kda_lm", "data", "testbed")
# The layers' entries into the parallel room.
LAYERS_MAY_IMPORT = ("kda_lm.parallel.context", "kda_lm.parallel.maps")


def room(module: str) -> str | None:
  """The room of a dotted module name (None: the package root)."""
  for name in sorted(RANKS, key=len, reverse=True):
    if module == name or module.startswith(name + "."):
      return name
  return None


def _import_statements(path: str):
  """(module, imported name or None, relative level) of each import."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from ((alias.name, None, 0) for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield from ((node.module, alias.name, node.level)
                  for alias in node.names)


def imports(path: str) -> list[str]:
  """Dotted modules a file imports (`from a import b` gives `a.b` when b
  is a module of the package, else `a`)."""
  found = []
  for module, name, level in _import_statements(path):
    if name is None or level:
      found += [] if level else [module]
      continue
    dotted = f"{module}.{name}"
    is_module = os.path.exists(
        os.path.join(ROOT, *dotted.split(".")) + ".py") or os.path.isdir(
            os.path.join(ROOT, *dotted.split(".")))
    found.append(dotted if is_module else module)
  tops = set(ROOM_TOPS) | above_rooms()
  return [m for m in found if m.split(".")[0] in tops]


def above_rooms() -> set[str]:
  """Top-level names no room imports: train.py, configs/, experiments/ and
  the tests' own modules (tests/ is on the path when they run)."""
  tests = os.path.join(ROOT, "tests")
  return {"train", "configs", "experiments", "tests"} | {
      name[:-3] for name in os.listdir(tests) if name.endswith(".py")}


def package_modules():
  for top in ROOM_TOPS:
    for folder, _, names in os.walk(os.path.join(ROOT, top)):
      for name in names:
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
          yield rel.removesuffix(".__init__"), path


def violations():
  bad, above = [], above_rooms()
  for module, path in package_modules():
    mine = room(module)
    if mine is None:
      continue
    for target in imports(path):
      if target.split(".")[0] in above:
        bad.append(f"{module} imports {target} (above every room)")
        continue
      theirs = room(target)
      if theirs is None or theirs == mine:
        continue
      if RANKS[theirs] >= RANKS[mine]:
        bad.append(f"{module} imports {target} ({mine} -> {theirs})")
      elif mine == "kda_lm.layers" and theirs == "kda_lm.parallel" and (
          not target.startswith(LAYERS_MAY_IMPORT)):
        bad.append(f"{module} imports {target}: layers reach the parallel "
                   f"room only through {LAYERS_MAY_IMPORT}")
  return bad


def test_every_module_belongs_to_a_room():
  homeless = [m for m, _ in package_modules()
              if room(m) is None and m not in ROOM_TOPS]
  assert not homeless, homeless


def test_imports_run_only_downwards():
  assert not violations(), "\n".join(violations())


def _violations_as(monkeypatch, path, modules):
  """`violations()` of the file `path` read as each of `modules`."""
  monkeypatch.setitem(globals(), "package_modules", lambda: iter(
      [(m, str(path)) for m in modules]))
  return violations()


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
  """A test that cannot fail is a defect: upward imports, and imports of
  what sits above every room, are reported."""
  fake = tmp_path / "m.py"
  fake.write_text("from kda_lm.train import loop\nfrom kda_lm import ops\n"
                  "from kda_lm.parallel import sharding\n"
                  "from configs import ling3_tiny\nimport helpers\n"
                  "from testbed import numerics\nimport numpy\n")
  assert imports(str(fake)) == [
      "kda_lm.train.loop", "kda_lm.ops", "kda_lm.parallel.sharding",
      "configs.ling3_tiny", "helpers", "testbed.numerics"]
  assert _violations_as(monkeypatch, fake, (
      "kda_lm.infer.fake", "kda_lm.layers.fake", "testbed.fake")) == [
      "kda_lm.infer.fake imports kda_lm.train.loop "
      "(kda_lm.infer -> kda_lm.train)",
      "kda_lm.infer.fake imports configs.ling3_tiny (above every room)",
      "kda_lm.infer.fake imports helpers (above every room)",
      "kda_lm.infer.fake imports testbed.numerics "
      "(kda_lm.infer -> testbed)",
      "kda_lm.layers.fake imports kda_lm.train.loop "
      "(kda_lm.layers -> kda_lm.train)",
      "kda_lm.layers.fake imports kda_lm.parallel.sharding: layers reach "
      "the parallel room only through ('kda_lm.parallel.context', "
      "'kda_lm.parallel.maps')",
      "kda_lm.layers.fake imports configs.ling3_tiny (above every room)",
      "kda_lm.layers.fake imports helpers (above every room)",
      "kda_lm.layers.fake imports testbed.numerics "
      "(kda_lm.layers -> testbed)",
      "testbed.fake imports configs.ling3_tiny (above every room)",
      "testbed.fake imports helpers (above every room)"]


def test_the_train_state_is_a_room_of_its_own(tmp_path, monkeypatch):
  """Inference and the Hugging Face import reach the training room only
  through its state module, which imports nothing of that room."""
  assert room("kda_lm.train.state") == "kda_lm.train.state"
  assert room("kda_lm.train.loop") == "kda_lm.train"
  fake = tmp_path / "m.py"
  fake.write_text("from kda_lm.train import state\n"
                  "from kda_lm.train import step\n")
  assert _violations_as(monkeypatch, fake, (
      "kda_lm.infer.fake", "kda_lm.hf.fake", "kda_lm.train.state")) == [
      "kda_lm.infer.fake imports kda_lm.train.step "
      "(kda_lm.infer -> kda_lm.train)",
      "kda_lm.hf.fake imports kda_lm.train.step "
      "(kda_lm.hf -> kda_lm.train)",
      "kda_lm.train.state imports kda_lm.train.step "
      "(kda_lm.train.state -> kda_lm.train)"]


def test_modules_and_functions_read_at_once():
  """Modules under 600 lines; functions at most 80 outside the kernels."""
  long_modules, long_functions = [], []
  for module, path in package_modules():
    with open(path, encoding="utf-8") as f:
      source = f.read()
    if source.count("\n") > 600:
      long_modules.append(module)
    if module.startswith("kda_lm.ops.kda.pallas"):
      continue  # Kernels keep their bodies whole.
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
          node.end_lineno - node.lineno + 1 > 80):
        long_functions.append(f"{module}.{node.name}")
  assert not long_modules and not long_functions, (long_modules,
                                                    long_functions)


# The library's only environment reads: the XLA:CPU flag set on import
# (kda_lm/__init__.py) and the multi-host start-up's CPU collectives
# (kda_lm/parallel/distributed.py). Settings are config keys and typed
# options (`KernelSettings`), never environment variables.
ENV_READERS = ("kda_lm/__init__.py", "kda_lm/parallel/distributed.py")


def environment_reads():
  """(path, line) of every os.environ / os.getenv use in kda_lm/."""
  found = []
  for module, path in package_modules():
    rel = os.path.relpath(path, ROOT)
    if not module.startswith("kda_lm") or rel in ENV_READERS:
      continue
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and isinstance(
          node.value, ast.Name) and node.value.id == "os" and (
              node.attr in ("environ", "getenv", "putenv")):
        found.append((rel, node.lineno))
  return found


def test_the_library_reads_no_environment_variable():
  assert environment_reads() == []


def imported_test_modules(path: str) -> list[str]:
  """The test modules (`*_test`) a file under tests/ imports."""
  return [module for module, _, _ in _import_statements(path)
          if module.split(".")[0].endswith("_test")]


def test_no_test_module_imports_another(tmp_path):
  """Shared test code lives in tests/helpers.py, the `*_support.py`
  modules and tests/conftest.py; a test module imported by another would
  run its tests twice and couple the two. (The check itself is shown to
  see such an import, and to let the shared modules through.)"""
  tests = os.path.join(ROOT, "tests")
  bad = {name: found for name in sorted(os.listdir(tests))
         if name.endswith(".py")
         and (found := imported_test_modules(os.path.join(tests, name)))}
  assert not bad, bad
  fake = tmp_path / "fake_test.py"
  fake.write_text("import model_test\nfrom train_loop_test import x\n"
                  "import helpers\nimport kda_support\n")
  assert imported_test_modules(str(fake)) == ["model_test", "train_loop_test"]


# Where a `model` section (ConfigDict, dict) is read into its
# `kda_lm.config.ModelConfig`: the edges, each function listed (None: the
# whole module). Below them the library takes the typed config, and
# `config.typed_model` refuses anything else.
MODEL_CONFIG_EDGES = {
    "kda_lm.config": None,               # The class; check_config.
    "kda_lm.model": {"_main"},           # python -m kda_lm.model
    "kda_lm.hf.formats": {"from_hf"},    # config.json, checked.
    "kda_lm.hf.convert": {"load_pretrained"},  # The import's config.
}


def _is_model_config(node: ast.AST) -> bool:
  """Whether an expression names the class (`config_lib.ModelConfig`)."""
  return (isinstance(node, ast.Name) and node.id == "ModelConfig") or (
      isinstance(node, ast.Attribute) and node.attr == "ModelConfig")


def _reads_model_config(call: ast.Call) -> bool:
  """`ModelConfig.from_config(x)` or `from_config(ModelConfig, x, ...)`."""
  f = call.func
  name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
  if name != "from_config":
    return False
  return (isinstance(f, ast.Attribute) and _is_model_config(f.value)) or (
      bool(call.args) and _is_model_config(call.args[0]))


def _calls(node: ast.AST, scope: tuple = ()):
  """(names of the enclosing functions, call) of every call under node."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, ast.Call):
      yield scope, child
    inner = scope
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
      inner = scope + (child.name,)
    yield from _calls(child, inner)


def model_config_reads() -> list[str]:
  """`module.function:line` of each read of a `ModelConfig` in kda_lm/
  outside `MODEL_CONFIG_EDGES`."""
  found = []
  for module, path in package_modules():
    edges = MODEL_CONFIG_EDGES.get(module, set())
    if not module.startswith("kda_lm") or edges is None:
      continue
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for scope, call in _calls(tree):
      if _reads_model_config(call) and not edges & set(scope):
        where = ".".join(scope) or "<module>"
        found.append(f"{module}.{where}:{call.lineno}")
  return found


def test_the_model_config_is_read_only_at_the_edges(tmp_path, monkeypatch):
  """The library takes `ModelConfig`, read once where a config enters; the
  check is shown to see a read anywhere else, nested or not, and to let an
  edge function through."""
  assert model_config_reads() == [], model_config_reads()
  fake = tmp_path / "m.py"
  fake.write_text(
      "from kda_lm import config as config_lib\n"
      "from kda_lm.config import ModelConfig, from_config\n"
      "def _main(c):\n"
      "  return config_lib.ModelConfig.from_config(c.model)\n"
      "def build(c):\n"
      "  def inner():\n"
      "    return ModelConfig.from_config(c)\n"
      "  return from_config(config_lib.ModelConfig, c, 'model')\n"
      "x = config_lib.OptConfig.from_config({})\n"
      "y = config_lib.ModelConfig.from_config({})\n")
  monkeypatch.setitem(globals(), "package_modules", lambda: iter(
      [("kda_lm.model", str(fake)), ("kda_lm.infer.fake", str(fake)),
       ("kda_lm.config", str(fake)), ("data.fake", str(fake))]))
  assert model_config_reads() == [
      "kda_lm.model.build.inner:7", "kda_lm.model.build:8",
      "kda_lm.model.<module>:10",
      "kda_lm.infer.fake._main:4", "kda_lm.infer.fake.build.inner:7",
      "kda_lm.infer.fake.build:8", "kda_lm.infer.fake.<module>:10"]
