"""A tower with ``compile: true`` (regional compilation: each block's forward through torch.compile,
inductor) trains like one eager process within float reordering, alone and composed with tensor
parallelism and FSDP2; a tower whose compilation fails runs eagerly, saying why once."""

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from distmm_testing import (
    Comparison,
    DeepCLIP,
    loader,
    max_param_diff,
    read_losses,
    run_distmm,
    run_reference,
)

import lightning_distmm as ldm
from lightning_distmm.parallel.compile import _Region

#: compiled kernels sum in another order than eager ones: measured differences on these plans are
#: below 1e-6 per weight after 3 AdamW steps (docs/runtime.md, "Compiling a tower")
COMPILED_TOL = 1e-5
SCRIPT = Path(__file__).parent / "scripts" / "compile_in_process.py"

#: torchtitan's order on the image tower: tensor parallelism, then the compiled blocks, then FSDP2 over
#: the replicas, whose batches are uneven (6 + 4 rows: one graph for both, the batch dimension
#: dynamic); the transformers text tower compiled on its two replicas, its first block recomputed
#: (the checkpoint inside the compiled region)
PLAN = ldm.Plan(
    4,
    {
        "image": {"ranks": [0, 1, 2, 3], "tp": 2, "shard": "full", "replica_batch": [6, 4], "compile": True},
        "text": {"ranks": [0, 2], "compile": True, "recompute": 1},
    },
    10,
)


class CompileReport(L.Callback):
    """Each rank writes what it compiled: its compiled regions, their failures, torch's graph count."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch._dynamo.utils import counters

        regions = [m.__dict__["forward"] for m in pl_module.modules() if isinstance(m.__dict__.get("forward"), _Region)]
        report = {
            "regions": len(regions),
            "failures": sorted({r.tower.failure for r in regions if r.tower.failure}),
            "graphs": counters["stats"]["unique_graphs"],
        }
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_compiled_towers_train_like_one_eager_process(tmp_path):
    L.seed_everything(0)
    reference = DeepCLIP("adamw", lr=0.01)
    module, initial = copy.deepcopy(reference), copy.deepcopy(reference)
    run_reference(reference, loader(10), 3, str(tmp_path / "ref.json"))
    run_distmm(module, PLAN, 4, loader(10), 3, str(tmp_path / "dist.json"), [CompileReport(tmp_path)])
    comparison = Comparison(
        reference, module, initial, read_losses(tmp_path / "ref.json"), read_losses(tmp_path / "dist.json")
    )
    print(f"largest weight difference to one eager process: {max_param_diff(reference, module):.2e}")
    comparison.assert_exact(COMPILED_TOL)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["regions"] > 0 and not r["failures"] for r in reports), reports  # compiled, none fell back
    # one graph per region kind and grad mode, whatever the replica's batch: no recompile per batch size
    assert all(r["graphs"] <= 4 for r in reports), reports


@functools.cache
def in_process() -> dict:
    """``tests/scripts/compile_in_process.py``'s findings: torch.compile run in a fresh interpreter
    (run in this pytest worker, it leaves the worker unable to run autograd in processes it forks
    later, and the suite's distributed tests fork)."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_tower_that_fails_to_compile_runs_eagerly_and_says_why():
    found = in_process()["fallback"]
    assert found["regions"] == 2  # the two blocks
    assert found["equal"]
    assert found["failure"] is not None and "this backend cannot compile anything" in found["failure"]
    warnings = found["warnings"]
    assert len(warnings) == 1 and "tower 'image': torch.compile failed" in warnings[0] and "eagerly" in warnings[0]
    assert found["restored"]  # eager forwards back in place


@pytest.mark.slow
def test_the_modules_own_error_is_raised_not_the_compilers():
    found = in_process()["own_error"]
    assert found["type"] == "RuntimeError"
    assert "cannot compile" not in found["message"]


def test_compile_is_a_plan_key():
    plan = ldm.Plan(2, {"image": {"ranks": [0], "compile": True}, "text": {"ranks": [1]}})
    again = ldm.Plan.from_dict(plan.to_dict())
    assert again.towers["image"].compile and not again.towers["text"].compile
    assert "+compile" in plan.table()
    with pytest.raises(ldm.PlanError, match="towers.image.compile"):
        ldm.Plan.from_dict({"world_size": 1, "towers": {"image": {"ranks": [0], "compile": "yes"}}})


@pytest.mark.slow
def test_compiling_a_compiled_tower_again_keeps_it_as_it_is():
    """A second Trainer call in the same process (fit, then validate) prepares the module again."""
    found = in_process()["compiled_again"]
    assert found["same"] and found["failure"] is None
