"""How ranks end and what they leave, under the launchers that start them from a parent process
(spawn, fork): their share of the cores, their process groups gone before the interpreter exits,
no files left in the temp directory, whether the run failed or ended well."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from distmm_testing import TinyCLIP, loader, trainer_kwargs
from job_testing import SCRIPTS, clean_env, expected_threads, failed_job_output, free_port, start_case

import lightning_distmm as ldm


def _left_in(temp: Path) -> list[str]:
    """What a run left in its temp folder (torch's compiler caches aside: they are meant to stay)."""
    return [
        str(p.relative_to(temp))
        for p in temp.rglob("*")
        if not p.relative_to(temp).parts[0].startswith("torchinductor_")
    ]


@pytest.mark.slow
def test_a_failed_spawn_run_leaves_no_files_in_the_temp_dir(tmp_path):
    """torch's spawn names a ``pytorch-errorfile-*.pickle`` per rank that a failed rank fills and
    nobody removes; distmm's launcher keeps them out of the temp directory, and the ranks' failure
    records go when the run is over."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = failed_job_output(start_case("spawn-rank1-raises", tmp_path, TMPDIR=str(temp)), tmp_path, within=180)
    assert "boom on rank 1" in out, out[-3000:]
    assert not _left_in(temp), _left_in(temp)


@pytest.mark.slow
def test_spawned_ranks_that_end_well_leave_nothing_behind(tmp_path):
    """One parent spawns two runs in turn (``scripts/rank_exit.py``: a plan without DTensors, then
    one with tp), and for each:

    - every rank exits with 0 and the handlers the run registered with ``atexit`` still ran. Before,
      the towers' meshes kept their gloo groups alive into the interpreter's finalisation, where a
      finished rank could abort; with no DTensors in the module, no gloo or store thread is left;
    - every spawned rank trained with its share of the cores (cpus // local ranks intra-op threads);
    - nothing is left in the temp directory: rank 0 hands the parent the trained weights in a file of
      a ``mkdtemp`` folder whose folder Lightning's parent does not remove; distmm writes it into the
      launch's scratch folder.
    """
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**clean_env(), "MASTER_PORT": str(free_port()), "TMPDIR": str(temp)}
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "rank_exit.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for plan in ("colocated", "tp"):
        assert (tmp_path / f"parent-{plan}").exists(), plan
        threads = {r: int((tmp_path / f"threads-{plan}-{r}").read_text()) for r in (0, 1)}
        assert threads == {0: expected_threads(2), 1: expected_threads(2)}, (plan, threads)
        at_exit = {r: (tmp_path / f"exit-{plan}-{r}").read_text().split() for r in (0, 1)}  # the atexit handlers ran
        if plan == "colocated":
            left = {r: [t for t in names if "gloo" in t or "tcpstore" in t] for r, names in at_exit.items()}
            assert left == {0: [], 1: []}, left
    assert not _left_in(temp), _left_in(temp)


class _Threads(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer, pl_module):
        (self.folder / f"threads{trainer.global_rank}").write_text(str(torch.get_num_threads()))


@pytest.mark.slow
def test_forked_ranks_get_their_share_of_the_cores(tmp_path):
    """The fork launcher (the notebook's) gives each rank cpus // local ranks intra-op threads too,
    from a parent whose environment sets none. (Under torchrun, torchrun itself sets
    ``OMP_NUM_THREADS=1`` for more than one process per node, and Lightning keeps what is set.)"""
    saved_env, saved_threads = os.environ.pop("OMP_NUM_THREADS", None), torch.get_num_threads()
    try:
        trainer = L.Trainer(
            devices=2,
            max_steps=1,
            strategy=ldm.DistMMStrategy("colocated", start_method="fork"),
            callbacks=[_Threads(tmp_path)],
            **trainer_kwargs(),
        )
        trainer.fit(TinyCLIP(), loader(4))
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if saved_env is not None:
            os.environ["OMP_NUM_THREADS"] = saved_env
        torch.set_num_threads(saved_threads)
    threads = {p.name: int(p.read_text()) for p in tmp_path.glob("threads*")}
    assert threads == {"threads0": expected_threads(2), "threads1": expected_threads(2)}, threads
