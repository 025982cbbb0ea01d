"""docs/design.md's map of the rooms names every module of the package in its room's row, so a new
module cannot land without a place on the map (and a word on what it does)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_distmm"


def room_rows() -> list[tuple[str, str]]:
    """The rooms table's rows as (first cell, the rest)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("## The rooms") : text.index("Arrows point one way")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows.append((cells[0], " ".join(cells[:2])))
    return rows


def test_every_module_is_on_the_map_in_its_rooms_row():
    rows = room_rows()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            continue  # a folder's own __init__ (the folder is the room), the package's entry
        top = rel.parts[0]
        key = f"`{top}/`" if len(rel.parts) > 1 else f"`{top}`"
        row = [files for first, files in rows if key in first]
        if not row or f"`{rel.name}`" not in row[0]:
            missing.append(str(rel))
    assert not missing, f"modules missing from docs/design.md's rooms table (each in its room's row): {missing}"


#: module names that appear in two folders, each the same concept from another layer (docs/design.md,
#: "Words, one meaning each"): the cost model prices what the runtime runs, the VLM planner mirrors
#: the planner, the cost options nest in the planner's
SAME_CONCEPT = {
    "gradients.py": {"planner/cost", "parallel/step"},
    "groups.py": {"planner/cost", "parallel"},
    "handoff.py": {"planner/cost", "parallel/step"},
    "memory.py": {"planner/cost", "parallel"},
    "pipeline.py": {"planner/cost", "parallel"},
    "default.py": {"planner", "planner/vlm"},
    "search.py": {"planner/search", "planner/vlm"},
    "partition.py": {"planner/search", "planner/vlm"},
    "profile.py": {"planner/profiles", "planner/vlm"},
    "options.py": {"planner", "planner/cost"},
}


def test_a_module_name_in_two_folders_is_one_concept_seen_from_two_layers():
    folders: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            folders.setdefault(path.name, set()).add(str(path.parent.relative_to(PACKAGE)))
    repeated = {name: where for name, where in folders.items() if len(where) > 1}
    unexplained = {n: sorted(w) for n, w in repeated.items() if SAME_CONCEPT.get(n) != w}
    assert not unexplained, f"module names repeated across folders without a reason in docs/design.md: {unexplained}"


def planner_module_map() -> set[str]:
    """The module paths in docs/planner.md's module map: the first cell of each row of the table under
    its "Module map" heading, as written there (relative to ``lightning_distmm/planner/``)."""
    text = (ROOT / "docs" / "planner.md").read_text()
    start = text.index("\n## Module map\n")
    section = text[start : text.index("\n## ", start + 1)]
    paths = set()
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        first = line.strip().strip("|").split("|")[0].strip()
        if first.startswith("`") and first.endswith("`"):
            paths.add(first.strip("`"))
    return paths


def test_every_planner_module_is_on_planner_mds_module_map_by_its_path():
    listed = planner_module_map()
    planner = PACKAGE / "planner"
    modules = {p.relative_to(planner).as_posix() for p in planner.rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - listed)
    assert not missing, f"planner modules missing from docs/planner.md's module map (by their path there): {missing}"
    stale = sorted(listed - modules)
    assert not stale, f"docs/planner.md's module map names modules that do not exist: {stale}"
