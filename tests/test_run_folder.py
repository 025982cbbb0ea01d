"""The run folder of failure records under the temp dir: never removed while a rank of the run may
still enter it, and nothing left behind once the run is over.

Each test replays, in one process and deterministically, an interleaving that the ranks of a real
job can produce (a pause injected where a rank is between two file operations); no rank processes
are started, so these run in the fast lane.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_distmm import faults
from lightning_distmm.faults import ErrorRelay, remove_stale_runs


class _PausedWrite:
    """Patches ``Path.write_text`` so that the first write into ``folder`` waits until released:
    a rank paused between making its run folder and writing its file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
        self.folder = folder
        self.reached = threading.Event()
        self.release = threading.Event()
        original = Path.write_text
        paused = self

        def write_text(path: Path, *args: object, **kwargs: object) -> int:
            if path.parent == paused.folder and not paused.reached.is_set():
                paused.reached.set()
                assert paused.release.wait(10), "the paused write was never released"
            return original(path, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)


def _in_thread(target: object) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def test_a_rank_ending_one_trainer_call_never_removes_the_folder_another_rank_is_entering(tmp_path, monkeypatch):
    """``fit`` then ``validate`` on the same ranks (one run id): rank 1 is done with ``fit`` and
    registers for ``validate`` while rank 0 is still tearing ``fit`` down. Rank 0's teardown must not
    take the run folder from under rank 1 (it did: ``FileNotFoundError: .../rank1.proc.tmp<pid>``)."""
    folder = tmp_path / "distmm-runs" / "run"
    relays = [ErrorRelay(folder, r) for r in range(2)]
    for relay in relays:
        relay.register()
    relays[1].clear()  # rank 1's fit ends first

    pause = _PausedWrite(monkeypatch, folder)
    thread, errors = _in_thread(relays[1].register)  # rank 1 enters validate
    assert pause.reached.wait(10)
    relays[0].clear()  # rank 0's fit ends while rank 1 is between mkdir and its write
    pause.release.set()
    thread.join(10)

    assert not errors, f"rank 1 could not register: {errors[0]!r}"
    assert json.loads((folder / "rank1.proc").read_text())["pid"] == os.getpid()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_stale_run_cleanup_never_touches_the_current_run(tmp_path, monkeypatch):
    """A rank's start-up removes runs whose processes are all gone, but never its own run's folder,
    whatever it holds: a process of this run that ended (a helper started under the same run id)
    leaves a ``rank*.proc`` of a dead pid while a live rank is entering."""
    root = tmp_path / "distmm-runs"
    current = root / "current"
    current.mkdir(parents=True)
    (current / "rank0.proc").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    stale = root / "stale"
    stale.mkdir()
    (stale / "rank0.proc").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    monkeypatch.setenv(faults.RUN_ID_ENV, "current")

    remove_stale_runs(root)

    assert current.is_dir() and (current / "rank0.proc").exists()
    assert not stale.exists()


def test_a_rank_whose_folder_vanishes_while_it_writes_makes_it_again(tmp_path, monkeypatch, caplog):
    """Folders are only removed empty, so the one window left is between ``mkdir`` and the first
    write (another run's last rank removing the shared, then empty, parent): the rank makes the
    folder again, writes, and says so in a debug line."""
    root = tmp_path / "distmm-runs"
    folder = root / "run"
    pause = _PausedWrite(monkeypatch, folder)
    relay = ErrorRelay(folder, 1)
    with caplog.at_level("DEBUG", logger="lightning_distmm.faults"):
        thread, errors = _in_thread(relay.register)
        assert pause.reached.wait(10)
        folder.rmdir()
        root.rmdir()
        pause.release.set()
        thread.join(10)
    assert not errors, f"the rank could not register: {errors[0]!r}"
    assert (folder / "rank1.proc").exists()
    assert any("vanished" in r.getMessage() for r in caplog.records)


def test_the_last_rank_out_leaves_nothing_and_a_failed_rank_keeps_its_record(tmp_path):
    root = tmp_path / "distmm-runs"
    ok = [ErrorRelay(root / "good", r) for r in range(2)]
    for relay in ok:
        relay.register()
    ok[0].leave()
    assert (root / "good" / "rank1.proc").exists()  # rank 1 is still in the run
    ok[1].leave()
    assert not root.exists()

    failed = ErrorRelay(root / "bad", 0)
    failed.register()
    failed.record(RuntimeError("boom"))
    failed.leave()  # the record outlives the rank: the others read it, then finish() removes it
    assert (root / "bad" / "rank0.json").exists()
    failed.finish(world_size=1)
    assert not root.exists()  # the failed run's folder and the then empty distmm-runs


def test_an_empty_run_folder_is_a_leftover_only_once_it_is_old(tmp_path, monkeypatch):
    root = tmp_path / "distmm-runs"
    fresh, old = root / "fresh", root / "old"
    fresh.mkdir(parents=True)
    old.mkdir()
    os.utime(old, (1.0, 1.0))
    monkeypatch.setenv(faults.RUN_ID_ENV, "another")
    remove_stale_runs(root)
    assert fresh.is_dir() and not old.exists()


def test_the_clean_up_tolerates_another_run_removing_the_root(tmp_path, monkeypatch):
    """Two runs on one host share the root: one may find it empty and remove it between the other's
    check that it exists and its listing (seen with two test workers). The listing then finds
    nothing to clean instead of failing the run at setup."""
    root = tmp_path / "distmm-runs"
    root.mkdir()
    listed = Path.iterdir

    def removed_meanwhile(self: Path):  # type: ignore[no-untyped-def]
        if self == root and root.is_dir():
            root.rmdir()  # the other run's clean-up, between is_dir() and the listing
        return listed(self)

    monkeypatch.setattr(Path, "iterdir", removed_meanwhile)
    remove_stale_runs(root)
    assert not root.exists()
