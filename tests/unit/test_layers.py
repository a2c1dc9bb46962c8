"""The package map as a rule: layers import downward only, and the runtime's processes
meet only on the bus.

Every import of an ``elaswave`` module is checked, at module level or inside a function,
under ``TYPE_CHECKING`` or not: ``bus`` -> ``comm`` -> ``fabric`` -> ``engine`` ->
``runtime`` and ``sim`` -> ``api`` and ``embedded`` -> ``cli`` (an arrow points from a
layer to one that may import it); ``model``, ``data``, ``rundir``, ``logs`` and
``osthreads`` are leaves any layer may import. Inside the runtime, ``job`` imports no
other subpackage, ``core`` and ``worker`` never import each other, and only ``host``
(which starts them) imports both.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elaswave

PACKAGE = Path(elaswave.__file__).parent
LEAVES = {"model", "data", "rundir", "logs", "osthreads", "__init__"}
RANK = {
    "bus": 0,
    "comm": 1,
    "fabric": 2,
    "engine": 3,
    "runtime": 4,
    "sim": 4,
    "api": 5,
    "embedded": 5,
    "cli": 6,
}
RUNTIME_MAY_IMPORT = {
    "job": {"job"},
    "core": {"job", "core"},
    "worker": {"job", "worker"},
    "host": {"job", "core", "worker", "host"},
}


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, module) of every elaswave import in ``path``, relative ones resolved."""
    here = _module_name(path, package).split(".")
    parent = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*parent[: len(parent) - node.level + 1], *filter(None, [base])])
            # ``from elaswave.runtime import worker`` imports elaswave.runtime.worker
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m.startswith("elaswave.")]


def _allowed(me: str, target: str) -> bool:
    mine, theirs = me.split(".")[1], target.split(".")[1]
    if theirs in LEAVES:
        return True
    if mine in LEAVES:
        return False
    if mine == theirs == "runtime":
        sub, other = me.split(".")[2:3], target.split(".")[2:3]
        return not sub or not other or other[0] in RUNTIME_MAY_IMPORT.get(sub[0], {other[0]})
    return mine == theirs or RANK[theirs] < RANK[mine]


def _violations(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        me = _module_name(path, package)
        if me == "elaswave":
            continue
        for line, target in _imports(path, package):
            if not _allowed(me, target):
                bad.append(f"{path.relative_to(package.parent)}:{line} imports {target}")
    return bad


def test_layers_import_downward_only() -> None:
    assert _violations() == []


def test_the_check_sees_upward_and_sideways_imports(tmp_path: Path) -> None:
    package = tmp_path / "elaswave"
    for folder in ("engine", "runtime/worker", "model"):
        (package / folder).mkdir(parents=True)
    (package / "engine" / "probe.py").write_text(
        "def f():\n    from elaswave.runtime.core import units\n"
    )
    (package / "runtime" / "worker" / "probe.py").write_text(
        "from elaswave.runtime.core.units import UnitHandle\nfrom ..job import config\n"
    )
    (package / "model" / "probe.py").write_text("import elaswave.bus.schema\n")
    assert _violations(package) == [
        "elaswave/engine/probe.py:2 imports elaswave.runtime.core.units",
        "elaswave/model/probe.py:1 imports elaswave.bus.schema",
        "elaswave/runtime/worker/probe.py:1 imports elaswave.runtime.core.units.UnitHandle",
    ]
