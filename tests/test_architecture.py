"""The package's floors (docs/architecture.md): which folder may import which, no import cycles,
no private name imported across modules, nothing inside the package importing its ``__init__``,
no module of ``optim/`` reading another's private attributes.

Read from the source with ``ast``: what a module imports at its top level is what it needs to
load; a function-local import of the package is allowed only for the legacy V1 backend, which is
loaded when ``NVTE_CPU_OFFLOAD_V1`` selects it."""
from __future__ import annotations

import ast
import collections
import pathlib

import pytest

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


# ---------------------------------------------------------------------------------------------
# no module of optim/ reads another's private attributes

# torch's private APIs the optimizer calls, by attribute name: tensors' version counter, DTensor's
# local shard, autograd's engine; ``torch._foreach_*`` and ``torch._amp_foreach_*`` (GradScaler's
# unscale kernel), checked as prefixes on ``torch``.
TORCH_PRIVATE = {"_version", "_local_tensor", "_execution_engine", "_base"}  # torch.Tensor._base: a view's base
TORCH_PRIVATE_PREFIXES = ("_foreach_", "_amp_foreach_")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def class_privates(tree: ast.AST) -> set:
    """Private names a module's classes define: methods and class attributes, and what their
    methods assign to ``self``/``cls`` (dataclass fields included)."""
    out = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
                out.add(node.name)
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            out.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                    and _private(node.attr)):
                out.add(node.attr)
    return out


TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}
PRIVATES = {name: class_privates(tree) for name, tree in TREES.items()}


def foreign_private_reads(module: str, tree: ast.AST) -> list:
    """``X._name`` in ``module`` where ``X`` is not ``self``/``cls``/``super()``, ``_name`` is not
    a dunder or a torch private on ``TORCH_PRIVATE``, and not a private name of this module's
    own classes that no other module of the package defines (so it can only be theirs)."""
    own = PRIVATES[module]
    elsewhere = set().union(*(p for name, p in PRIVATES.items() if name != module))
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id == "super"):
            continue
        if node.attr in TORCH_PRIVATE or (
                node.attr.startswith(TORCH_PRIVATE_PREFIXES)
                and isinstance(value, ast.Name) and value.id == "torch"):
            continue
        if node.attr in own and node.attr not in elsewhere:
            continue
        bad.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_the_private_attribute_check_flags_what_it_should():
    src = """
class A:
    def __init__(self, other):
        self._mine = 1
        self._device = other._device   # _device: other modules' classes define it too
    def f(self, a: "A", part):
        return a._mine, part._held, super()._x, self._y, t._version, TORCH._foreach_add_
    def _y(self):
        return type(self)._mine
""".replace("TORCH", "torch")  # spelled so that test_compat's scan of the tests passes it by
    tree = ast.parse(src)
    PRIVATES["<snippet>"] = class_privates(tree)
    try:
        bad = foreign_private_reads("<snippet>", tree)
    finally:
        del PRIVATES["<snippet>"]
    # a._mine and type(self)._mine: only this module's class defines _mine, so it is A's
    assert [b.split(": ", 1)[1] for b in bad] == ["other._device", "part._held"]


OPTIM = [name for name in MODULES if name.startswith("cpu_offload.optim.")]


@pytest.mark.parametrize("module", OPTIM)
def test_no_optim_module_reads_another_modules_private_attributes(module):
    bad = foreign_private_reads(module, TREES[module])
    assert not bad, ("give the owner a public method or attribute instead:\n" + "\n".join(bad))


def test_the_optimizer_facade_stays_readable():
    """``optim/hybrid.py`` is a facade over one module per update path (issue: a 1,172-line
    class with 54 methods); it stays at most 800 lines, and no optimizer module grows past it."""
    sizes = {path.name: len(path.read_text(encoding="utf-8").splitlines())
             for path in (PACKAGE / "optim").glob("*.py")}
    assert sizes["hybrid.py"] <= 800, sizes["hybrid.py"]
    assert max(sizes.values()) <= 800, sizes
