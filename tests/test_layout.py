"""The package's one dependency rule (docs/design.md, "Layout"): imports go down the layers, never up, and the
packages of one layer do not import each other in a cycle. Read from the source with ``ast``, type-only imports
included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_solo

PACKAGE = Path(lightning_solo.__file__).parent
# app → {callbacks, diagnostics} → {ddp, fsdp} → checkpoint → core → _compat. The root modules are the public
# API and the command shims, above everything; _version is read by anything.
LAYERS = {"_compat": 0, "_version": 1, "core": 1, "checkpoint": 2, "ddp": 3, "fsdp": 3, "callbacks": 4,
          "diagnostics": 4, "app": 5, "conf": 5}  # fmt: skip
TOP = 6


def _unit(module: str) -> str:
    """The layer unit of a dotted module: its first package below lightning_solo (a root module stands alone)."""
    return module.split(".")[1] if module.count(".") else module


def _imports() -> dict[str, set[str]]:
    """Each module's lightning_solo imports, as dotted names."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names = found.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_solo"):
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("lightning_solo"))
    return found


def _layer(module: str) -> int:
    return LAYERS.get(_unit(module), TOP) if module.count(".") else TOP


def test_imports_go_down_the_layers():
    upward = [
        f"{module} ({_unit(module)}) imports {name} ({_unit(name)})"
        for module, names in _imports().items()
        for name in names
        if name.count(".") and _layer(name) > _layer(module)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for module, names in _imports().items():
        for name in names:
            if name.count(".") and module.count(".") and _unit(name) != _unit(module):
                edges.setdefault(_unit(module), set()).add(_unit(name))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    cycles = sorted(unit for unit in edges if reaches(unit, unit, {unit}))
    assert not cycles, f"packages in an import cycle: {cycles} ({edges})"


def test_the_root_holds_the_api_and_the_commands_only():
    root = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py")
    commands = ["consolidate.py", "evaluate.py", "export.py", "preflight.py", "run.py"]
    assert root == sorted(["__init__.py", "_version.py", "testing.py", *commands])
    for command in commands:  # a shim: the code lives in its package
        assert len((PACKAGE / command).read_text().splitlines()) <= 10, command


def test_nothing_outside_ddp_reads_a_private_attribute_of_the_strategy():
    pattern = re.compile(r"strategy\._[a-z]|getattr\([\w.]*strategy, \"_")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "ddp" not in path.relative_to(PACKAGE).parts[:1]
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, "\n".join(offenders)


def _module_edges() -> dict[str, set[str]]:
    """Each module's imports of other modules of the package (a ``from package import name`` of a module names
    that module; of anything else, the package), lazy imports inside functions included."""
    imports = _imports()
    modules = set(imports)
    edges: dict[str, set[str]] = {}
    for module, names in imports.items():
        for name in names:
            target = name if name in modules else name.rsplit(".", 1)[0]
            if target in modules and target != module:
                edges.setdefault(module, set()).add(target)
    return edges


def test_no_cycle_between_modules():
    edges = _module_edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in edges.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    assert not cycles, f"modules in an import cycle: {cycles}"
