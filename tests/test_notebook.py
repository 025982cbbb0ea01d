"""recipes/notebook.ipynb runs headless (nbclient, a fresh ipykernel), a few steps, so it cannot rot.

The kernel is a separate process in its own session: the notebook's fork launcher forks the ranks
from it as it would in Jupyter, and a cell past its timeout fails the test (nbclient then shuts the
kernel down, which kills its process group, the forked ranks included).
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "recipes" / "notebook.ipynb"
STEPS = 5


def _text(nb) -> str:
    """Every stream and text/plain output of the executed notebook, in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "text/plain" in out.get("data", {}):
                parts.append(out["data"]["text/plain"])
    return "".join(parts)


@pytest.mark.slow
def test_notebook_runs_headless(tmp_path, monkeypatch):
    monkeypatch.setenv("LDM_NOTEBOOK_STEPS", str(STEPS))  # the kernel inherits this environment
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError (with the traceback) on a failing cell, CellTimeoutError on a hang
    text = _text(nb)
    assert f"train/loss after {STEPS} steps: " in text
    assert "image->text" in text and "text->image" in text
