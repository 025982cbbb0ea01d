"""Resuming a job on the machines that are left (torchrun's elastic restart, a requeued SLURM job).

torchrun (``--nnodes MIN:MAX --max-restarts N``) restarts the surviving nodes' workers when a node
is lost, on the new membership; the script runs again from its start. What it needs from here:

* :func:`last_checkpoint`: the newest *complete* checkpoint folder in a ``ModelCheckpoint``'s
  ``dirpath`` (None before the first), for ``trainer.fit(..., ckpt_path=last_checkpoint(dirpath))``.
  A folder a lost node was still writing is never it: a complete one has DCP's ``.metadata`` (the
  coordinator writes it after every shard), Lightning's ``meta.pt`` (rank 0, after) and every shard
  the metadata names at its full length.
* the plan for the new world size: ``DistMMStrategy(plan={8: "big.yaml", 4: "small.yaml"})`` or a
  folder of ``<world size>.yaml`` (:class:`~lightning_distmm.plan_choice.PlansByWorldSize`), or a
  plan chosen at setup (no plan, ``"auto"``), which is chosen for whatever world it finds.
* one log line when a run resumes under another plan or after a restart (:func:`resume_line`),
  which says which plan replaced which, from which checkpoint, and how many steps were lost: rank
  0 notes each step it starts in the checkpoint folder (:class:`ProgressNote`, a file of a few bytes
  replaced each step).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from lightning_distmm.core.plan import Plan

PROGRESS_FILE = "distmm-progress.json"
_STEP = re.compile(r"step=(\d+)")


def restart_count() -> int:
    """How many times torchrun's agent restarted this job's workers (0: the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole distmm checkpoint folder (never one a lost node was writing)."""
    from lightning_distmm.checkpoint import check_shards

    folder = Path(path)
    if not (folder / ".metadata").is_file() or not (folder / "meta.pt").is_file():
        return False
    try:
        check_shards(folder)
    except Exception:  # noqa: BLE001 - any damage makes it incomplete
        return False
    return True


def _order(path: Path) -> tuple[int, float]:
    found = _STEP.search(path.name)
    return (int(found.group(1)) if found else -1, path.stat().st_mtime)


def last_checkpoint(dirpath: str | os.PathLike) -> str | None:
    """The newest complete checkpoint folder in ``dirpath`` (by the ``step=N`` in its name, then its
    time), or None when there is none yet (the first start of the job)."""
    folder = Path(dirpath)
    if not folder.is_dir():
        return None
    newest_first = sorted((p for p in folder.iterdir() if p.is_dir()), key=_order, reverse=True)
    return next((str(p) for p in newest_first if is_complete(p)), None)  # checks only down to the first whole one


def complete_or_newest(path: Path) -> tuple[Path, str | None]:
    """``path`` when it is a complete checkpoint; else the newest complete one beside it, with the
    line that says so (a folder a lost node was still writing: ``ckpt_path="last"`` after a failure);
    an error that says what to do when there is none."""
    if is_complete(path):
        return path, None
    newest = last_checkpoint(path.parent)
    if newest is None:
        raise FileNotFoundError(
            f"checkpoint {path} is incomplete (a save that did not finish) and {path.parent} holds no complete"
            " one: start without ckpt_path, or point it at a complete checkpoint folder"
        )
    return Path(newest), f"distmm: checkpoint {path} is incomplete (a save that did not finish): resuming from {newest}"


def plan_line(plan: Plan) -> str:
    """A plan in one line: each tower's ranks and parallelism."""
    parts = []
    for name, t in plan.towers.items():
        shard = f" {t.shard}" if t.shard != "none" else ""
        parts.append(f"{name} on ranks {list(t.ranks)} (dp{t.dp} tp{t.tp} pp{t.pp}{shard})")
    return f"{plan.world_size} ranks: " + ", ".join(parts)


class ProgressNote:
    """Rank 0's note of the step it is running (counted from 1: a checkpoint at step N holds N steps),
    next to the checkpoints, so that a restarted run can say how many steps were lost."""

    def __init__(self, dirpath: str | os.PathLike | None) -> None:
        self.path = Path(dirpath) / PROGRESS_FILE if dirpath is not None else None

    def note(self, step: int, world_size: int) -> None:
        if self.path is None or not self.path.parent.is_dir():
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step, "world_size": world_size}))
        os.replace(tmp, self.path)

    @staticmethod
    def read(dirpath: str | os.PathLike) -> dict[str, Any] | None:
        try:
            return json.loads((Path(dirpath) / PROGRESS_FILE).read_text())
        except (OSError, ValueError):
            return None


def resume_line(path: Path, step: int, before: Plan | None, now: Plan, progress: dict[str, Any] | None) -> str:
    """What a resumed run says: the checkpoint, the plan it was saved under and the one now, the steps lost."""
    reached = progress.get("step") if progress else None
    lost = f"; the run before had started step {reached}: {reached - step} step(s) lost" if reached is not None else ""
    restarted = f"elastic restart {restart_count()}: " if restart_count() else ""
    if before is None:
        was = "a plan it did not record"
    elif before.to_dict() == now.to_dict():
        was = "the same plan"
    else:
        was = plan_line(before)
    return f"distmm: {restarted}resumed from {path} at step {step}, saved under {was}, now under {plan_line(now)}{lost}"
