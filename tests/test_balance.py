"""Each step's rows assigned to the replicas by their cost (``Tower(cost=...)``): the assignment
itself, and training under it exactly like one process."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import (
    SEQ,
    DeepCLIP,
    GroupedDeepCLIP,
    PairData,
    TinyCLIP,
    max_param_diff,
    read_losses,
    run_distmm,
    run_reference,
)
from torch.utils.data import DataLoader
from vlm_testing import SkewedVLMData, compare_vlm

import lightning_distmm as ldm
from lightning_distmm.core.assignment import RowAssignment, _assign, _imbalance, balance_rows, loads
from lightning_distmm.core.layout import ASSIGNMENT_KEY, RankLayout
from lightning_distmm.models.vlm import VLM

INTERNVL = {1: 0.2, 3: 0.3, 5: 0.3, 7: 0.2}  # images (tiles) per sample


def _draw(rng: random.Random, weights: dict[int, float], n: int) -> list[int]:
    return rng.choices(list(weights), list(weights.values()), k=n)


def _two_towers(dp: int, **image: Any) -> ldm.Plan:
    text = {"schedule": image["schedule"]} if "schedule" in image else {}
    return ldm.Plan(dp + 1, {"image": {"ranks": list(range(dp)), **image}, "text": {"ranks": [dp], **text}})


# ---------------------------------------------------------------------- the assignment
@pytest.mark.parametrize("plan", [_two_towers(3), _two_towers(2, schedule="distmm"), _two_towers(4)])
def test_every_row_once_every_replica_some(plan):
    rng = random.Random(0)
    for n in (8, 9, 13):
        cost = [float(c) for c in _draw(rng, INTERNVL, n)]
        a = balance_rows(plan, n, {"image": cost})
        assert sorted(a.order or range(n)) == list(range(n))
        start = 0
        for g, rows in enumerate(plan.group_split(n)):
            # a sync group's positions hold its own rows (its negatives are unchanged)
            assert sorted(a.rows(start, start + rows)) == list(range(start, start + rows))
            for name in plan.towers:
                sizes = a.sizes[name][g]
                assert sum(sizes) == rows and min(sizes) >= 1
            start += rows
        assert a.sizes["text"] == RowAssignment.even(plan, n).sizes["text"]  # no cost: the plan's split


def test_count_fixed_tower_keeps_its_counts():
    """A sharded tower cut into microbatches keeps the plan's counts (its replicas' collectives pair
    up microbatch by microbatch) and is balanced by which rows it takes."""
    plan = _two_towers(2, shard="full", microbatch=2)
    cost = [7.0, 7.0, 5.0, 7.0, 1.0, 1.0, 3.0, 1.0]
    a = balance_rows(plan, 8, {"image": cost})
    assert a.sizes["image"] == ((4, 4),)
    got = loads(a, plan, "image", cost)
    assert sum(got) == sum(cost)
    even = loads(RowAssignment.even(plan, 8), plan, "image", cost)
    assert max(got) == 16.0 < max(even) == 26.0  # 7+7+1+1 | 7+5+3+1 against 7+7+5+7 | 1+1+3+1


def test_two_costed_towers_share_one_order():
    """One step order for every tower; each tower cuts it into its own runs: one tower leads (takes
    the rows largest-first), the other cuts the lead's order by an exact search over its run
    boundaries, so that no boundary moved by one row lowers its slowest replica."""
    plan = ldm.Plan(5, {"image": {"ranks": [0, 1, 2]}, "text": {"ranks": [3, 4]}})
    rng = random.Random(1)
    led = set()
    for _ in range(50):
        costs = {
            "image": [float(c) for c in _draw(rng, INTERNVL, 12)],
            "text": [float(rng.randint(1, 30)) for _ in range(12)],
        }
        a = balance_rows(plan, 12, costs)
        order = list(a.order or range(12))

        def best_cut(tower: str) -> bool:
            sizes = list(a.sizes[tower][0])
            now = max(loads(a, plan, tower, costs[tower]))
            for i in range(len(sizes) - 1):
                for d in (-1, 1):
                    moved = sizes.copy()
                    moved[i] += d
                    moved[i + 1] -= d
                    if min(moved) < 1:
                        continue
                    ends = [sum(moved[:j]) for j in range(len(moved) + 1)]
                    other = [sum(costs[tower][r] for r in order[ends[j] : ends[j + 1]]) for j in range(len(moved))]
                    if max(other) < now - 1e-9:
                        return False
            return True

        assert best_cut("image") or best_cut("text"), "neither tower's runs are the best cut of the shared order"
        # the lead kept is the one whose worst tower is best
        worst = {
            lead: max(_imbalance(_assign(plan, 12, costs, lead), plan, t, costs[t]) for t in costs)
            for lead in ("image", "text")
        }
        got = max(_imbalance(a, plan, t, costs[t]) for t in costs)
        assert got == pytest.approx(min(worst.values()))
        led.add(min(worst, key=worst.get))
    assert led == {"image", "text"}  # each tower led some batches


@pytest.mark.parametrize("per_replica, bound", [(2, 1.15), (4, 1.07), (8, 1.03)])
def test_balanced_encoder_is_near_the_mean(per_replica, bound, capsys):
    """InternVL-like images per sample, 16 encoder replicas: the slowest replica over the mean, an
    even split against the balanced one (mean of 100 batches)."""
    dp = 16
    plan = _two_towers(dp)
    rng = random.Random(0)
    even, balanced = [], []
    for _ in range(100):
        n = dp * per_replica
        cost = [float(c) for c in _draw(rng, INTERNVL, n)]
        mean = sum(cost) / dp
        even.append(max(loads(RowAssignment.even(plan, n), plan, "image", cost)) / mean)
        balanced.append(max(loads(balance_rows(plan, n, {"image": cost}), plan, "image", cost)) / mean)
    e, b = sum(even) / len(even), sum(balanced) / len(balanced)
    with capsys.disabled():
        print(f"\n{per_replica} rows per replica, dp {dp}: slowest / mean even {e:.3f}, balanced {b:.3f}")
    assert b <= bound < e


def test_layout_loads_the_rows_of_its_run():
    plan = _two_towers(2)
    a = RowAssignment(6, [5, 0, 3, 1, 2, 4], {"image": [[2, 4]], "text": [[6]]})
    assert RankLayout(plan, 0, {"image": ["image"], "text": ["t"]}).batch(6, a).rows == (5, 0)
    assert RankLayout(plan, 1, {"image": ["image"], "text": ["t"]}).batch(6, a).rows == (3, 1, 2, 4)
    assert RankLayout(plan, 2, {"image": ["image"], "text": ["t"]}).batch(6, a).rows == (5, 0, 3, 1, 2, 4)
    assert a.group_inverse(0, 6) == [1, 3, 4, 2, 5, 0]


def test_bad_cost_fields_are_named():
    from lightning_distmm.data.loader.step_balance import CostBalancer

    plan = _two_towers(2)
    samples = [{"n_images": 1}, {"n_images": -1}, {"n_images": 2.5}, {"other": 1}, {"n_images": True}]

    def balancer(i: int) -> CostBalancer:
        return CostBalancer(plan, {"image": "n_images"}, lambda index, f: samples[index], "Mine")

    with pytest.raises(ValueError, match=r"sample 1 of Mine \(row 1 of the batch\) has n_images=-1"):
        balancer(0)([0, 1])
    with pytest.raises(ValueError, match=r"n_images=2.5.*count"):
        balancer(0)([0, 2])
    with pytest.raises(KeyError, match=r"sample 3 of Mine .* no field\(s\) \['n_images'\].*\['image'\]"):
        balancer(0)([0, 3])
    with pytest.raises(ValueError, match=r"n_images=True"):
        balancer(0)([0, 4])
    with pytest.raises(ValueError, match=r"tower 'image': cost=3"):
        CostBalancer(plan, {"image": 3}, lambda index, f: samples[index], "Mine")  # type: ignore[dict-item]


# ---------------------------------------------------------------------- training under it
class CostedPairs(PairData):
    """PairData with each caption's token count as a field (the text tower's cost) and a made-up
    image count (the image tower's), so that consecutive rows cost very differently."""

    fields = (*PairData.fields, "n_tokens", "n_images")

    def load(self, index: int, fields: Any) -> dict[str, Any]:
        out = super().load(index, [f for f in fields if f in PairData.fields])
        if "n_tokens" in fields:
            out["n_tokens"] = 2 + index % (SEQ - 2)
        if "n_images" in fields:
            out["n_images"] = [1, 7, 3, 5, 1, 1, 7, 2][index % 8]
        return out


def _costed(base: type) -> type:
    class Costed(base):  # type: ignore[misc, valid-type]
        def towers(self) -> dict[str, ldm.Tower]:
            t = super().towers()
            t["image"].cost = "n_images"
            t["text"].cost = {"n_tokens": 1.0}
            return t

    Costed.__name__ = f"Costed{base.__name__}"
    return Costed


class _Assignments(L.Callback):
    """Rank 0 writes each step's assignment (its order and run lengths)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 0 and isinstance(trainer.strategy, ldm.DistMMStrategy):
            a = batch.get(ASSIGNMENT_KEY)
            with open(self.out, "a") as f:
                f.write(json.dumps(None if a is None else [a.order, {k: v for k, v in a.sizes.items()}]) + "\n")


BALANCED_PLANS = {
    "image-dp2+text": ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}}),
    "image-dp2+text-dp2": ldm.Plan(4, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2, 3]}}),
    "colocated-dp3": ldm.Plan(3, {"image": {"ranks": [0, 1, 2]}, "text": {"ranks": [0, 1, 2]}}),
    "distmm-image-dp2-mb2+text": ldm.Plan(
        3,
        {
            "image": {"ranks": [0, 1], "schedule": "distmm", "microbatch": 2},
            "text": {"ranks": [2], "schedule": "distmm"},
        },
    ),
    "image-tp2-dp2+text": ldm.Plan(5, {"image": {"ranks": [0, 1, 2, 3], "tp": 2}, "text": {"ranks": [4]}}),
    "image-pp2+text-dp2": ldm.Plan(
        4, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 2}, "text": {"ranks": [2, 3]}}
    ),
    "image-fsdp2+text-fsdp2": ldm.Plan(
        4, {"image": {"ranks": [0, 1], "shard": "full"}, "text": {"ranks": [2, 3], "shard": "full"}}
    ),
}


def _compare(make, plan: ldm.Plan, batch: int, steps: int, tmp_path: Path) -> tuple[float, list[Any]]:
    L.seed_everything(0)
    reference = make()
    module = copy.deepcopy(reference)
    initial = copy.deepcopy(reference)

    def data() -> DataLoader:
        return DataLoader(
            CostedPairs(64), batch_size=batch, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3)
        )

    run_reference(reference, data(), steps, str(tmp_path / "ref.json"))
    log = tmp_path / "assignments.jsonl"
    run_distmm(
        module, plan, plan.world_size, data(), steps, str(tmp_path / "dist.json"), callbacks=[_Assignments(str(log))]
    )
    diff = max_param_diff(reference, module)
    assert max_param_diff(reference, initial) > 1e-3
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)
    return diff, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(BALANCED_PLANS))
def test_balanced_steps_train_like_one_process(name, optimizer, tmp_path, capsys):
    plan = BALANCED_PLANS[name]
    lr = 0.05 if optimizer == "sgd" else 0.01
    base = GroupedDeepCLIP if "distmm" in name else (DeepCLIP if ("tp2" in name or "pp2" in name) else TinyCLIP)
    diff, steps = _compare(lambda: _costed(base)(optimizer, lr=lr), plan, 8, 3, tmp_path)
    with capsys.disabled():
        print(f"\n{name} {optimizer}: max parameter diff {diff:.2e}; step 0 assignment {steps[0]}")
    assert diff <= 1e-5
    assert len(steps) == 3 and all(s is not None for s in steps)
    # the assignments really moved rows out of sample order
    assert any(s[0] is not None for s in steps)
    assert any(s[0] != sorted(s[0]) for s in steps if s[0] is not None)


def test_balance_is_a_plan_key():
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}}, balance="rows")
    again = ldm.Plan.from_yaml(plan.to_yaml())
    assert again.balance == "rows" and again.to_dict() == plan.to_dict()
    assert "balance" not in ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}}).to_dict()
    with pytest.raises(ldm.PlanError, match="balance: expected 'cost', 'rows' or null, got 'even'"):
        ldm.Plan.from_yaml(plan.to_yaml().replace("rows", "even"))


@pytest.mark.slow
def test_a_plan_with_balance_rows_splits_by_count(tmp_path):
    """``balance: rows`` in the plan turns balancing off for a module whose towers name a cost (the
    strategy's default is ``cost``): no step carries an assignment, and training is the one-process one."""
    plan = ldm.Plan(3, {"image": {"ranks": [0, 1]}, "text": {"ranks": [2]}}, balance="rows")
    diff, steps = _compare(lambda: _costed(TinyCLIP)("sgd", lr=0.05), plan, 8, 3, tmp_path)
    assert diff <= 1e-5 and steps == [None, None, None]


# ---------------------------------------------------------------------- an encoder feeding an LLM
VLM_PLANS = {
    # (devices, plan, global batch)
    "image-dp2+llm1": (3, ldm.Plan(3, {"image": {"ranks": [0, 1]}, "llm": {"ranks": [2]}}), 6),
    "image-dp3+llm-dp2-shared": (4, ldm.Plan(4, {"image": {"ranks": [0, 1, 2]}, "llm": {"ranks": [2, 3]}}), 7),
    "image-dp2-mb2+llm-mb3": (
        3,
        ldm.Plan(3, {"image": {"ranks": [0, 1], "microbatch": 2}, "llm": {"ranks": [2], "microbatch": 3}}),
        8,
    ),
    "image-dp2+llm-pp2": (4, ldm.Plan(4, {"image": {"ranks": [0, 1]}, "llm": {"ranks": [2, 3], "pp": 2}}), 6),
    "image-dp2+llm-tp2": (4, ldm.Plan(4, {"image": {"ranks": [0, 1]}, "llm": {"ranks": [2, 3], "tp": 2}}), 6),
    "image+llm-fsdp2": (3, ldm.Plan(3, {"image": {"ranks": [0]}, "llm": {"ranks": [1, 2], "shard": "full"}}), 6),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VLM_PLANS))
def test_balanced_vlm_trains_like_one_process(name, tmp_path, capsys):
    """The encoder balanced by its images, the LLM by its image and text tokens: each LLM replica
    reads its rows' image tokens from whichever encoder replicas hold them, in step order."""
    devices, plan, batch = VLM_PLANS[name]
    log = tmp_path / "assignments.jsonl"
    cost = {"image": "n_images", "llm": {"n_images": 5, "n_tokens": 1}}
    c = compare_vlm(
        lambda: VLM(optimizer="adamw", lr=0.01, eps=1e-6, cost=cost),
        plan,
        devices,
        batch=batch,
        steps=3,
        tmp_path=tmp_path,
        callbacks=[_Assignments(str(log))],
        data=SkewedVLMData,
    )
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    with capsys.disabled():
        print(f"\n{name}: losses {c.distributed_losses}; step 0 assignment {steps[0]}")
    c.assert_exact(1e-5)
    assert len(steps) == 3 and any(s[0] is not None and s[0] != sorted(s[0]) for s in steps)


@pytest.mark.slow
def test_balanced_resume_continues_exactly(tmp_path):
    """A run stopped mid-epoch and resumed from its checkpoint trains the same steps, assigned the
    same way, as the run that never stopped (the assignment is a function of the batch's rows)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    plan = BALANCED_PLANS["image-dp2+text"]
    L.seed_everything(0)
    straight = _costed(TinyCLIP)("adamw", lr=0.01)
    first_half, resumed = copy.deepcopy(straight), copy.deepcopy(straight)

    def data() -> DataLoader:  # 6 batches an epoch: step 2 is mid-epoch
        return DataLoader(
            CostedPairs(48), batch_size=8, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(3)
        )

    logs = {k: tmp_path / f"{k}.jsonl" for k in ("straight", "half", "resumed")}
    run_distmm(
        straight, plan, 3, data(), 4, str(tmp_path / "straight.json"), callbacks=[_Assignments(str(logs["straight"]))]
    )
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    run_distmm(
        first_half,
        plan,
        3,
        data(),
        2,
        str(tmp_path / "half.json"),
        callbacks=[saver, _Assignments(str(logs["half"]))],
        enable_checkpointing=True,
    )
    folder = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    run_distmm(
        resumed,
        plan,
        3,
        data(),
        4,
        str(tmp_path / "resumed.json"),
        ckpt_path=str(folder),
        callbacks=[_Assignments(str(logs["resumed"]))],
    )
    assert max_param_diff(straight, resumed) <= 1e-6
    losses = read_losses(tmp_path / "straight.json")
    assert read_losses(tmp_path / "resumed.json") == pytest.approx(losses[2:], abs=1e-6)
    steps = {k: log.read_text().splitlines() for k, log in logs.items()}
    assert steps["half"] + steps["resumed"] == steps["straight"]
    assert any(json.loads(s)[0] is not None for s in steps["straight"])
