"""A job restarted on fewer ranks (torchrun's elastic restart after a lost node) resumes by itself:
the plan for its world size, the newest complete checkpoint (never one a lost node was writing),
one line saying what changed; training equals one process on the same global batches."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from distmm_testing import TinyCLIP, loader, max_param_diff, rank0_log, read_losses, run_distmm, run_reference
from lightning.pytorch.callbacks import ModelCheckpoint
from test_multinode import _env, _port, wait_for_listener

import lightning_distmm as ldm
from lightning_distmm.plan_choice import PlansByWorldSize, parse_plan_spec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
THREE = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}})
TWO = ldm.Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}})


def test_plans_by_world_size(tmp_path):
    spec = parse_plan_spec({3: THREE, "2": "auto"})
    assert isinstance(spec, PlansByWorldSize)
    assert spec.for_world(3) is THREE and spec.for_world(2) == "auto"
    with pytest.raises(ldm.PlanError, match="none for a world of 4 ranks \\(entries: 2, 3\\): add one for 4"):
        spec.for_world(4)
    with pytest.raises(ldm.PlanError, match="the plan given for world size 2 is a plan for 3 ranks"):
        parse_plan_spec({2: THREE})
    THREE.to_yaml(tmp_path / "3.yaml")
    TWO.to_yaml(tmp_path / "2.yaml")
    folder = parse_plan_spec(tmp_path)
    assert isinstance(folder, PlansByWorldSize) and folder.for_world(2).to_dict() == TWO.to_dict()
    with pytest.raises(FileNotFoundError, match="holds no '<world size>.yaml'"):
        parse_plan_spec(tmp_path / "ckpt" if (tmp_path / "ckpt").mkdir() is None else None)


@pytest.mark.slow
def test_a_run_restarted_on_fewer_ranks_resumes_with_their_plan(tmp_path):
    """3 ranks train 3 steps (a checkpoint at step 2, saved asynchronously) and stop; a save of step 4 that a lost node
    left half-written sits beside it. The restart on 2 ranks takes the plan for 2, is pointed at the
    half-written folder (``ckpt_path="last"`` would be) and resumes from step 2 instead, to step 6."""
    plans = {3: THREE, 2: TWO}
    L.seed_everything(0)
    reference = TinyCLIP("adamw", lr=0.01)
    first = copy.deepcopy(reference)
    data = lambda: loader(8, size=48)  # noqa: E731 - step 2 is mid-epoch
    run_reference(reference, data(), 6, str(tmp_path / "ref.json"))

    saves = tmp_path / "ckpt"
    saver = ModelCheckpoint(dirpath=saves, every_n_train_steps=2, save_top_k=-1)
    strategy = ldm.DistMMStrategy(plan=plans, start_method="fork", async_save=True)  # written in the background
    run_distmm(first, strategy, 3, data(), 3, str(tmp_path / "a.json"), callbacks=[saver], enable_checkpointing=True)
    complete = saves / "epoch=0-step=2.ckpt"
    torn = saves / "epoch=0-step=4.ckpt"
    shutil.copytree(complete, torn)
    (torn / ".metadata").unlink()  # DCP's coordinator never got to write it
    assert ldm.last_checkpoint(saves) == str(complete)

    resumed = copy.deepcopy(first)
    with rank0_log(tmp_path / "rank0.log"):  # rank 0's lines, to a file
        run_distmm(resumed, plans, 2, data(), 6, str(tmp_path / "b.json"), ckpt_path=str(torn))
    said = (tmp_path / "rank0.log").read_text()
    lines = [line for line in said.splitlines() if "distmm: " in line and "resum" in line]
    print("\n" + "\n".join(lines))
    assert any(f"checkpoint {torn} is incomplete" in line and str(complete) in line for line in lines)
    (line,) = [line for line in lines if "resumed from" in line]
    assert "at step 2, saved under 3 ranks: image on ranks [0, 1] (dp2 tp1 pp1)" in line
    assert "now under 2 ranks: image on ranks [0] (dp1 tp1 pp1)" in line
    assert "the run before had started step 3: 1 step(s) lost" in line
    losses = read_losses(tmp_path / "ref.json")
    assert read_losses(tmp_path / "b.json") == pytest.approx(losses[2:], abs=1e-5)
    assert max_param_diff(reference, resumed) <= 1e-5


@pytest.mark.slow
def test_torchrun_restarts_the_survivors_with_their_plan(tmp_path):
    """`torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d` started twice
    (two "nodes", the first hosting the rendezvous); the second kills its agent and ranks when step 4
    starts. The first node's agent restarts its ranks alone: they take the plan for 2 ranks, resume
    from step 2's checkpoint and train to step 6, equal to one process. The workers keep their own
    store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: on the agent's shared store the restarted ranks
    read their peers' addresses from before the restart; docs/multinode.md)."""
    endpoint = f"127.0.0.1:{_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    command += ["--rdzv-id", "distmm-elastic", "--rdzv-conf", "join_timeout=120,last_call_timeout=5"]
    command += ["--monitor-interval", "0.5", str(SCRIPT), str(tmp_path)]
    env = _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    logs = [tmp_path / f"node{n}.log" for n in range(2)]
    procs = []
    for n, log in enumerate(logs):
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
        if n == 0:  # the first node hosts the rendezvous (it outlives the second): start the second once it listens
            wait_for_listener(endpoint, procs[0])
    try:
        procs[0].wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    said = logs[0].read_text(errors="replace")
    assert procs[0].returncode == 0, said[-4000:]
    final = json.loads((tmp_path / "final.json").read_text())
    killed = json.loads((tmp_path / "killed.json").read_text())["time"]
    restarted = json.loads((tmp_path / "first-step-restart1.json").read_text())
    lines = [line for line in said.splitlines() if "distmm: " in line and ("resumed" in line or "world of" in line)]
    print(f"\nnode 1 killed when step 4 started; the survivors' first step {restarted['time'] - killed:.1f} s later")
    print("\n".join(lines))
    assert final["world_size"] == 2 and restarted["step"] == 2
    assert any(
        "elastic restart 1: resumed from" in line and "step=2" in line and "2 step(s) lost" in line for line in lines
    )

    L.seed_everything(0)
    reference = TinyCLIP("sgd", lr=0.05)
    run_reference(reference, loader(8), 6, str(tmp_path / "ref.json"))
    trained, expected = torch.load(tmp_path / "weights.pt"), reference.state_dict()
    assert trained.keys() == expected.keys()
    assert max((trained[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
