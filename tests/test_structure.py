"""The package's structure: no import circles, a driver that loads no model, trainer or engine,
no function over 60 lines, and worker methods named in one table.

Every import counts, wherever it is written (module top, inside a function, under TYPE_CHECKING),
and `from tandem.a.b import c` also imports the package `tandem.a`, whose `__init__` runs first:
a circle through any of them is one a reader has to untangle, and one that breaks when an import
moves.
"""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tandem"


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def absolute(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a `from ... import` names, a relative one resolved from the importer's `package`."""
    base = node.module or ""
    if node.level:
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return base


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The tandem modules `name` imports, anywhere in its file, with the packages they sit in."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, package)
            # `from pkg import mod` imports pkg.mod; `from pkg import name` takes name from pkg's __init__
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    explicit = {m for m in found if m in known}
    packages = {".".join(m.split(".")[:i]) for m in explicit for i in range(2, m.count(".") + 1)}
    # The packages `name` sits in are being imported already when it runs: no edge to them, unless
    # it takes a name from one of them (then their __init__ must have run past the import of `name`).
    packages = {p for p in packages if p in known and not name.startswith(p + ".")}
    return (explicit | packages) - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                out.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycles():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


HEAVY = (
    "tandem.model",
    "tandem.train",
    "tandem.rollout.engine",
    "tandem.rollout.paged_engine",
    "tandem.rollout.vllm_engine",
    "tandem.rollout.worker",
    "tandem.rollout.model_runner",
)
# A checkpoint's shape (its config.json, rope scaling checked on read) is what the simulator plans
# with; the decoder, the trainers and the engines are what it must not load.
SHAPE_ONLY = ("tandem.model", "tandem.model.config", "tandem.model.rope")


def heavy(module: str) -> bool:
    return any(module == h or module.startswith(h + ".") for h in HEAVY)


def loaded_by(module: str) -> list[str]:
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('tandem')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


def test_the_driver_loop_loads_no_model_trainer_or_engine():
    loaded = [m for m in loaded_by("tandem.controller.loop") if heavy(m)]
    assert loaded == [], f"importing tandem.controller.loop loads {loaded}"


def test_the_simulator_loads_a_model_shape_but_no_model_trainer_or_engine():
    loaded = [m for m in loaded_by("tandem.sim") if heavy(m) and m not in SHAPE_ONLY]
    assert loaded == [], f"importing tandem.sim loads {loaded}"


def test_no_function_in_the_package_is_longer_than_60_lines():
    long = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno >= 60
            ):
                long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}")
    assert long == []


def longer_than(limit: int, texts: dict[str, str]) -> list[str]:
    """The names of the texts of more than `limit` lines."""
    counts = {name: len(text.splitlines()) for name, text in texts.items()}
    return [f"{name} ({n})" for name, n in counts.items() if n > limit]


def test_no_file_in_the_package_is_longer_than_500_lines():
    """A file over 500 lines does more than one job: split it by job (nano-vllm's are under ~260)."""
    texts = {str(path.relative_to(ROOT.parent)): path.read_text() for path in sorted(ROOT.rglob("*.py"))}
    assert longer_than(500, texts) == []


def test_the_length_finder_finds_a_long_file():
    assert longer_than(500, {"a.py": "x\n" * 501, "b.py": "x\n" * 500}) == ["a.py (501)"]


def package_of(module: str) -> str:
    """The folder of tandem a module is in (`tandem.serve.workers` -> `serve`), or for a module at
    the top (`tandem.errors`) the module itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def private_imports(name: str, source: str, known: set[str], is_package: bool = False) -> list[str]:
    """Where module `name` takes a private name (`_x`, a module `_x` included) of a module in another
    folder of tandem: `from tandem.a.b import _x`, `import tandem.a._b`, or an attribute `_x` reached
    through such a module by the name it was imported as (`b._x` after `from tandem.a import b`,
    `tandem.a.b._x`, `b.Class._x`)."""
    own = package_of(name)
    package = name.split(".") if is_package else name.split(".")[:-1]
    modules: dict[str, str] = {}  # a name this module binds -> the tandem module it is
    found: list[tuple[int, str]] = []

    def crosses(module: str) -> bool:
        return module.startswith("tandem.") and package_of(module) != own

    def flag(node: ast.AST, what: str) -> None:
        found.append((node.lineno, what))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if crosses(a.name) and any(private(p) for p in a.name.split(".")):
                    flag(node, a.name)
                if a.asname:
                    modules[a.asname] = a.name
                elif a.name.startswith("tandem"):
                    modules["tandem"] = "tandem"
        elif isinstance(node, ast.ImportFrom):
            base = absolute(node, package)
            for a in node.names:
                full = f"{base}.{a.name}"
                if crosses(base) and (private(a.name) or any(private(p) for p in base.split("."))):
                    flag(node, full)
                if full in known:
                    modules[a.asname or a.name] = full
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and private(node.attr) and (path := dotted(node.value)):
            head, _, rest = path.partition(".")
            module = ".".join([modules[head], rest] if rest else [modules[head]]) if head in modules else ""
            if crosses(module):
                flag(node, f"{module}.{node.attr}")
    return [f"{name}:{line} {what}" for line, what in sorted(found)]


def test_no_private_name_is_imported_across_packages():
    """A name with a leading underscore is its folder's own: another folder that needs it asks for
    a public one, so the owner knows what others rely on."""
    known = modules()
    found = [
        hit
        for name, path in sorted(known.items())
        for hit in private_imports(name, path.read_text(), set(known), path.name == "__init__.py")
    ]
    assert found == []


def test_the_private_import_finder_finds_one_across_packages():
    source = """
import tandem.runtime.actors
import tandem.runtime.actors as actors
from tandem.runtime import actors as act
from tandem.runtime.actors import _plan, plan
from tandem.runtime._hidden import x
from tandem.serve.wire import _own
from .wire import _also_own

a = tandem.runtime.actors._plan
b = actors._plan, act._plan, actors.plan, actors.__name__
c = self._plan
"""
    known = {"tandem.runtime.actors", "tandem.serve.wire"}
    assert private_imports("tandem.serve.workers", source, known) == [
        "tandem.serve.workers:5 tandem.runtime.actors._plan",
        "tandem.serve.workers:6 tandem.runtime._hidden.x",
        "tandem.serve.workers:10 tandem.runtime.actors._plan",
        "tandem.serve.workers:11 tandem.runtime.actors._plan",
        "tandem.serve.workers:11 tandem.runtime.actors._plan",
    ]
    # from the other side: the serve names are private to serve; `.wire` is runtime's own
    assert private_imports("tandem.runtime.workers", source, known) == [
        "tandem.runtime.workers:7 tandem.serve.wire._own"
    ]


def test_the_driver_names_worker_methods_only_in_its_call_table():
    from tandem.controller.calls import ROUTES

    methods = {route.method for route in ROUTES.values()}
    found = []
    for path in (ROOT / "controller").glob("*.py"):
        if path.name == "calls.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in methods:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert found == []


def test_every_engine_the_config_accepts_has_a_builder():
    from tandem.rollout.engines import ENGINES

    for name in ENGINES.names():  # its builder imports (the engine itself loads only when called)
        assert callable(ENGINES.get(name).builder()), name


# Where each kind of name has its one registry: a role (tandem.runtime.role_table), an engine
# (tandem.rollout.engines), an agent kind (tandem.agent.build), a tool parser (tandem.agent.chat).
REGISTRY_OWNERS = {
    "engine": "rollout/engines.py",
    "agent kind": "agent/build.py",
    "tool parser": "agent/chat.py",
}


def _names_by_registry() -> dict[str, list[str]]:
    from tandem.agent import AGENT_KINDS
    from tandem.agent.chat import TOOL_PARSERS
    from tandem.rollout.engines import ENGINES

    return {"engine": ENGINES.names(), "agent kind": AGENT_KINDS.names(), "tool parser": TOOL_PARSERS.names()}


def _literals(node: ast.AST) -> list[str]:
    """The string constants `node` is or holds (a tuple, list or set of them)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def test_engines_agent_kinds_and_tool_parsers_are_asked_of_their_registry_never_compared_by_name():
    """Outside its registry's module no code compares with an engine's, agent kind's or tool
    parser's name (`x == "vllm"`, `spec.startswith("openai:")`): it asks the entry's traits, so a
    new entry is one registration."""
    owners = {kind: ROOT / rel for kind, rel in REGISTRY_OWNERS.items()}
    found = []
    for kind, names in _names_by_registry().items():
        for path in ROOT.rglob("*.py"):
            if path == owners[kind]:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                called = getattr(getattr(node, "func", None), "attr", "")
                if isinstance(node, ast.Compare):
                    hits = [v for c in (node.left, *node.comparators) for v in _literals(c) if v in names]
                elif kind == "agent kind" and called == "startswith":
                    hits = [v for a in node.args for v in _literals(a) if v.removesuffix(":") in names]
                else:
                    continue
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {kind} {v!r}" for v in hits]
    assert found == []


def test_the_clusters_build_every_role_from_the_roles_table():
    """The Ray cluster, the one-process cluster and the simulator name no role's worker class or
    worker: each builds what the roles table's rows give (a new role is one row). The training
    service (`serve/`) names no worker either ("train/0"): its workers come from the same rows. It
    may name the worker classes it subclasses (the class overrides a cluster is built with)."""
    from tandem.runtime.role_table import ROLES, table

    builders = ["runtime/cluster.py", "runtime/local.py", "sim/run.py", "runtime/placement.py"]
    service = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "serve").glob("*.py"))
    classes = {r.worker.partition(":")[2] for r in table()}
    found = []
    for rel in builders + service:
        tree, builds = ast.parse((ROOT / rel).read_text()), rel in builders
        for node in ast.walk(tree):
            if builds and isinstance(node, ast.ImportFrom) and node.module == "tandem.runtime.actors":
                found.append(f"{rel}:{node.lineno} imports the actors")
            if builds and isinstance(node, ast.Name) and node.id in classes:
                found.append(f"{rel}:{node.lineno} {node.id}")
            for v in _literals(node) if isinstance(node, ast.Constant) else []:
                if "/" in v and v.split("/")[0] in ROLES and v.split("/")[1].isdigit():
                    found.append(f"{rel}:{node.lineno} {v!r}")
    assert found == []
    for role in table():  # every row's worker class and simulated builder import
        assert callable(role.worker_class()) and callable(role.simulator()), role.name


def test_config_is_a_leaf():
    """`tandem.config` reads and types recipes; it imports nothing of tandem above it (the value checks,
    which ask engines, losses and tasks, run at start-up: `tandem.runtime.checks`)."""
    known = modules()
    allowed = {"tandem", "tandem.errors", "tandem.sample"}
    above = {
        f"{name} -> {target}"
        for name, path in known.items()
        if name == "tandem.config" or name.startswith("tandem.config.")
        for target in imported(name, path, known)
        if target not in allowed and not target.startswith("tandem.config")
    }
    assert above == set()
