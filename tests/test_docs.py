"""The README's figures that the code can check: the fast lane's size (kept true by this test, not
by memory; its time is measured and written by hand, since a timed test would fail on a busy host)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fast_lane_of(session: pytest.Session) -> int | None:
    """The fast lane's size from this session's own collection, when it collected the whole suite
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
