"""The package's floors (docs/architecture.md): which folder may import which, no import cycles,
no private name imported across modules, nothing inside the package importing its ``__init__``.

Read from the source with ``ast``: what a module imports at its top level is what it needs to
load; a function-local import of the package is allowed only for the legacy V1 backend, which is
loaded when ``NVTE_CPU_OFFLOAD_V1`` selects it."""
from __future__ import annotations

import ast
import collections
import pathlib

import cpu_offload

PACKAGE = pathlib.Path(cpu_offload.__file__).resolve().parent

# floor -> the floors its modules may import at their top level (besides themselves).
ALLOWED = {
    "compat": set(),
    "core": {"compat"},
    "v1": {"compat", "core"},
    "v2": {"compat", "core"},
    "optim": {"compat", "core"},
    "api": {"compat", "core", "v2"},
    "control": {"api", "compat", "core", "v2"},
    "config": {"api", "compat", "core", "optim"},
    "tools": {"api", "compat", "control", "core", "v2"},
    "plan": {"api", "compat", "core", "tools", "v2"},
    "examples": {"api", "compat", "control", "core"},
    "integrations": {"api", "compat", "control", "core", "plan", "tools", "v2"},
}
LAZY_ALLOWED = {"v1"}  # floors a function may import when it runs


def modules() -> dict:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["cpu_offload", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def imports(name: str, path: pathlib.Path):
    """``(imported module, imported name or None, top_level)`` for each package import."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body} | {
        id(n) for t in tree.body if isinstance(t, (ast.Try, ast.If)) for n in t.body
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, id(node) in top
                else:
                    yield target, alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpu_offload"):
            for alias in node.names:
                yield node.module, alias.name, id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cpu_offload"):
                    yield alias.name, None, id(node) in top


def floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_each_floor_imports_only_the_floors_below_it():
    bad = []
    for name, path in MODULES.items():
        mine = floor(name)
        if mine not in ALLOWED:  # the package's __init__ and __main__ see everything
            continue
        for target, _, top in imports(name, path):
            theirs = floor(target)
            if theirs == mine:
                continue
            allowed = ALLOWED[mine] if top else ALLOWED[mine] | LAZY_ALLOWED
            if theirs not in allowed:
                where = "at the top" if top else "inside a function"
                bad.append(f"{name} imports {target} {where}")
    assert not bad, "imports that go up or sideways (docs/architecture.md):\n" + "\n".join(bad)


def test_no_private_name_crosses_a_module_boundary():
    bad = []
    for name, path in MODULES.items():
        for target, imported, _ in imports(name, path):
            if imported is not None and imported.startswith("_"):
                bad.append(f"{name} imports {imported} from {target}")
    assert not bad, "make them public names in their home module:\n" + "\n".join(bad)


def test_nothing_inside_the_package_imports_its_init():
    bad = [
        f"{name} imports {imported or target}"
        for name, path in MODULES.items() if name != "cpu_offload"
        for target, imported, _ in imports(name, path)
        if target == "cpu_offload"
    ]
    assert not bad, "import from the module that defines the name:\n" + "\n".join(bad)


def test_no_import_cycles():
    graph = collections.defaultdict(set)
    for name, path in MODULES.items():
        for target, _, top in imports(name, path):
            if not top:
                continue
            parts = target.split(".")
            for i in range(2, len(parts) + 1):  # importing a.b.c runs a.b's __init__ first
                dep = ".".join(parts[:i])
                if dep in MODULES and not name.startswith(dep + ".") and dep != name:
                    graph[name].add(dep)
    state: dict = {}
    cycles = []

    def visit(module: str, stack: list) -> None:
        state[module] = "open"
        stack.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)
