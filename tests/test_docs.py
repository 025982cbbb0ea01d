"""What the docs say that the code can check: the README's fast-lane size (kept true by this test, not
by memory; its time is measured and written by hand, since a timed test would fail on a busy host),
and that every citation of a section of docs/planner.md or docs/planner-results.md by its heading
names a heading that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fast_lane_of(session: pytest.Session) -> int | None:
    """The fast lane's size from this run's own collection, when it collected the whole suite
    unfiltered (the full run, on every pytest-xdist worker); None otherwise."""
    option = session.config.option
    if getattr(option, "markexpr", "") or getattr(option, "keyword", ""):
        return None
    files = {Path(str(item.path)).name for item in session.items}
    if files != {p.name for p in (ROOT / "tests").glob("test_*.py")}:
        return None
    return sum(1 for item in session.items if item.get_closest_marker("slow") is None)


@pytest.mark.slow
def test_the_readmes_fast_lane_count_is_the_suites(request):
    stated = re.search(r"The fast lane \((\d[\d,]*) tests marked not slow", (ROOT / "README.md").read_text())
    assert stated, "README.md no longer states the fast lane's size ('The fast lane (N tests marked not slow')"
    count = _fast_lane_of(request.session)
    if count is None:  # this file run on its own: collect the fast lane in a pytest of its own
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        found = re.search(r"(\d+)/\d+ tests collected", out.stdout)
        assert found, out.stdout[-2000:] + out.stderr[-2000:]
        count = int(found.group(1))
    readme = int(stated.group(1).replace(",", ""))
    assert count == readme, f"README.md says the fast lane has {readme} tests; it has {count}: update README.md"


#: where a section of the planner's pages is cited by name (CHANGELOG.md keeps its history as written)
CITING = ("lightning_distmm", "tests", "benchmarks", "recipes", "conf", "docs")
PLANNER_PAGES = ("planner.md", "planner-results.md")


def _headings(page: str) -> set[str]:
    text = (ROOT / "docs" / page).read_text()
    return {m.group(1).strip() for m in re.finditer(r"(?m)^#+ (.+)$", text)}


def _one_line(cited: str) -> str:
    """A cited heading as one line: wrapped lines joined, a comment's ``#`` and a Python escape dropped."""
    return re.sub(r"\s*\n\s*(#\s*)?", " ", cited).replace("\\'", "'").strip()


def test_every_cited_planner_section_exists():
    headings = {page: _headings(page) for page in PLANNER_PAGES}
    files = [ROOT / "README.md"] + [
        p for d in CITING for p in sorted((ROOT / d).rglob("*")) if p.suffix in {".py", ".md", ".yaml"}
    ]
    cite = re.compile(r"(planner(?:-results)?\.md),\s+(?:\"((?:[^\"\\]|\\.)+)\"|'([^']+)')")
    wrong = []
    for path in files:
        text = path.read_text()
        for m in cite.finditer(text):
            cited = _one_line(m.group(2) or m.group(3))
            if cited not in headings[m.group(1)]:
                wrong.append(f"{path.relative_to(ROOT)}: {m.group(1)}, {cited!r}")
        if path.parent.name == "docs" and path.name in PLANNER_PAGES:  # a page citing its own sections
            own = re.finditer(r'(?:see |\* )"([^"]+)"|"([^"]+)",\s+(?:above|below)', text)
            for m in own:
                cited = _one_line(m.group(1) or m.group(2))
                # the planner page's "Results" list cites the results page
                page = "planner-results.md" if m.group(0).startswith("*") else path.name
                if cited not in headings[page]:
                    wrong.append(f"{path.relative_to(ROOT)}: {page}, {cited!r}")
    assert not wrong, "citations of a planner section whose heading does not exist:\n" + "\n".join(wrong)
