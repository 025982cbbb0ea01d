"""The package's layers point one way (docs/design.md): checked on the source and on a live import.

``core`` is the contract every rank runs by (no torch, no Lightning, no other package module);
``planner`` is pure Python above it (no torch.distributed, no Lightning); ``parallel`` is the
runtime (torch, no Lightning); the Lightning wiring sits on top. Every import counts, including
imports inside functions and under ``TYPE_CHECKING``: an arrow pointing up is a circle waiting
to happen.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_distmm"

#: each area and the areas it may import (besides itself); anything else is an arrow pointing up
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "planner": {"core"},
    "tower": set(),
    "interaction": set(),
    "faults": set(),
    "losses": {"interaction"},
    "parallel": {"core", "tower", "interaction"},
    "data": {"core"},
    "checkpoint": {"core", "tower", "parallel"},
    "mixin": {"core", "tower", "interaction"},
    "models": {"core", "tower", "interaction", "losses", "mixin", "parallel"},
    "lightning_seam": {"core", "tower", "parallel", "checkpoint"},
    "rank_failures": {"faults", "lightning_seam"},
    "plan_choice": {"core", "planner", "parallel", "tower", "lightning_seam"},
    "elastic": {"core", "checkpoint"},
    "async_checkpoint": {"checkpoint"},
    "drift_replan": {"core", "planner", "parallel", "lightning_seam", "plan_choice"},
    "strategy": {
        "core",
        "planner",
        "tower",
        "interaction",
        "parallel",
        "data",
        "checkpoint",
        "mixin",
        "lightning_seam",
        "faults",
        "rank_failures",
        "plan_choice",
        "elastic",
        "async_checkpoint",
        "drift_replan",
    },
    "__init__": {
        "core",
        "tower",
        "interaction",
        "losses",
        "data",
        "checkpoint",
        "mixin",
        "strategy",
        "lightning_seam",
        "elastic",
    },  # fmt: skip
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def area(module: str) -> str:
    """``lightning_distmm.parallel.runtime`` -> ``parallel``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    """Every ``lightning_distmm`` module ``path`` imports, at any depth of the file."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_distmm"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("lightning_distmm"):
                # ``from lightning_distmm.core import schedule``: the submodule when it is one
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if _is_module(sub) else node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; the package uses absolute imports")
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def area_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The imports between areas: (importing area, imported area), each pair once."""
    return {(area(m), area(t)) for m, targets in graph.items() for t in targets if area(t) != area(m)}


def layers(arrows: set[tuple[str, str]], areas: set[str]) -> dict[str, int]:
    """Each area's layer: 0 for an area that imports no other, else one above the highest it imports."""
    level: dict[str, int] = {}

    def of(a: str, seen: tuple[str, ...] = ()) -> int:
        if a not in level:
            below = [of(b, (*seen, a)) for s, b in arrows if s == a and b not in seen]
            level[a] = 1 + max(below) if below else 0
        return level[a]

    return {a: of(a) for a in areas}


def test_layers_point_one_way():
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        src = area(module)
        for target in targets:
            dst = area(target)
            if dst != src and dst not in ALLOWED.get(src, set()):
                wrong.append(f"{module} -> {target}")
    arrows, areas = area_arrows(graph), {area(m) for m in graph}
    level = layers(arrows, areas)
    # the house in numbers (docs/design.md quotes them): ``pytest -s tests/test_layers.py -k one_way``
    print(
        f"\n{len(areas)} areas on {max(level.values()) + 1} layers, {len(arrows)} arrows between areas, {len(wrong)} up"
    )
    assert not wrong, "imports that point up the layers (docs/design.md):\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    graph = import_graph()
    # Tarjan's strongly connected components over modules
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ importing its own submodules is not a circle unless they import it back
    assert not circles, f"import circles: {circles}"


def test_core_is_free_of_every_other_package_module():
    for module, targets in import_graph().items():
        if area(module) == "core":
            assert all(area(t) == "core" for t in targets), f"{module} imports {sorted(targets)}"


_LIVE_IMPORT = """
import importlib, json, sys, types
from pathlib import Path
# load the subpackage without the package's __init__ (which registers the Lightning strategies)
pkg = types.ModuleType("lightning_distmm")
pkg.__path__ = [sys.argv[1]]
sys.modules["lightning_distmm"] = pkg
for name in sys.argv[2:]:
    importlib.import_module(name)
    for sub in sorted(Path(sys.argv[1], name.split(".")[1]).rglob("*.py")):
        rel = sub.relative_to(Path(sys.argv[1]).parent).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        importlib.import_module(".".join(parts))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning"))))
"""


@pytest.mark.parametrize(
    "subpackage, forbidden",
    [
        ("lightning_distmm.core", ("torch", "lightning", "pytorch_lightning")),
        ("lightning_distmm.planner", ("torch", "lightning", "pytorch_lightning")),
    ],
)
@pytest.mark.slow
def test_pure_layers_import_neither_torch_distributed_nor_lightning(subpackage, forbidden):
    """Imported on their own, every module of core and planner leaves torch (whose import pulls in
    torch.distributed) and Lightning unloaded: the planner measures with torch only inside functions."""
    out = subprocess.run(
        [sys.executable, "-c", _LIVE_IMPORT, str(PACKAGE), subpackage],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] in forbidden], f"{subpackage} loads {loaded[:10]}"


def area_imports() -> dict[str, set[str]]:
    """Area -> the other areas its modules import (what docs/design.md's table states)."""
    out: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        src = area(module)
        out.setdefault(src, set()).update(area(t) for t in targets if area(t) != src)
    return out


def _design_table() -> dict[str, set[str]]:
    """docs/design.md's "What each area imports" table: area -> the areas it says it imports."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    start = text.index("| area | imports from the package |")
    table: dict[str, set[str]] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        left, right = (cell.strip() for cell in line.strip("|").split("|"))
        imports = set(re.findall(r"`([\w_]+)`", right))
        for name in re.findall(r"`([\w_]+)`", left):
            table[name] = imports
    return table


#: the order of the areas in docs/design.md's table (the layers, bottom up)
AREA_ORDER = [
    "core", "planner", "tower", "interaction", "faults", "losses", "parallel", "data", "checkpoint", "mixin",
    "models", "lightning_seam", "rank_failures", "plan_choice", "elastic", "async_checkpoint", "drift_replan", "strategy", "__init__",
]  # fmt: skip


def design_table() -> str:
    """The table's rows as the code has them (paste into docs/design.md when an import changes)."""
    actual = area_imports()
    rank = {name: i for i, name in enumerate(AREA_ORDER)}
    rows = []
    for name in sorted(actual, key=lambda n: rank.get(n, len(rank))):
        imported = sorted(actual[name], key=lambda n: rank.get(n, len(rank)))
        rows.append(f"| `{name}` | {', '.join(f'`{x}`' for x in imported) or '—'} |")
    return "\n".join(rows)


def test_the_design_pages_import_table_is_the_codes():
    """Each row of docs/design.md's import table equals what the code imports, area by area, and
    every area has a row: the page is kept true by this test, not by memory."""
    actual, stated = area_imports(), _design_table()
    wrong = [
        f"{name}: the page says {sorted(stated.get(name, {'(no row)'}))}, the code imports {sorted(actual.get(name, set()))}"
        for name in sorted(set(actual) | set(stated))
        if stated.get(name) != actual.get(name, set())
    ]
    assert not wrong, (
        "docs/design.md's import table drifted:\n"
        + "\n".join(wrong)
        + "\nthe rows as the code has them:\n"
        + design_table()
    )


#: modules over this many lines are split at their concepts (docs/design.md)
MAX_MODULE_LINES = 400


def test_module_sizes():
    """Prints every package module's size and fails on one over the limit (docs/design.md, "Size of
    modules"): a module that long holds more than one concept."""
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in sorted(PACKAGE.rglob("*.py"))}
    over = {m: n for m, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n > MAX_MODULE_LINES}
    largest = dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:5])
    print(f"\n{len(sizes)} modules, {sum(sizes.values())} lines; the largest: {largest}")
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}: split them at their concepts"
