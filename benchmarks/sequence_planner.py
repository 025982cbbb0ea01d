"""What context and sequence parallelism buy the long tower of the long-sequence presets (predicted).

For each preset (``clip_vit_l14_448``: 1,025 image tokens; ``siglip_so400m_384``: 729 image
tokens; ``clip_vit_l14_longtext``: 248 text tokens) on two 8-GPU nodes (``--cluster``), the long
tower gets the first node and the other tower the second (data parallel, 8 replicas). The long
tower's node is then planned by hand: data parallel (dp8), TP-only (tp 2 / 4 / 8), TP + SP, CP
(2 / 4 / 8), CP x TP, FSDP (``shard: full``, over the replicas and cp ranks), and the ``cached`` schedule (gradient cache, microbatches of 8 rows). Every
variant is a runtime ``Plan`` (validated as the runtime validates it: a degree the heads do not
allow is named) priced by the cost model (``planner.price.price_plan``: the Ulysses all-to-alls,
SP's gathers, activation memory with ``cp`` / ``sp``). The table gives, per variant, the largest
global batch whose step fits the GPUs' memory (doubling, then bisection) and the step time at
``--global-batch`` (``-`` where it does not fit), the fastest marked. Nothing here is measured:
these are the cost model's predictions.

A second table gives the planner's own choice (``make_plan`` on the same 16 GPUs, ``shards: [none,
full]``) without and with ``planner.sequence`` (the search enumerates cp / sp with the other degrees,
then tries the chosen devices' other ways): the long tower's devices and degrees and the predicted
step, and how long the search took.

Usage: ``python benchmarks/sequence_planner.py [--cluster a100_8x8] [--global-batch 256]``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import yaml

from lightning_distmm.core.plan import Plan, PlanError, TowerPlan
from lightning_distmm.planner.machine.config import CONF_DIR
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.price import price_plan
from lightning_distmm.planner.profiles.profile import model_profiles

#: preset -> its long tower
PRESETS = {"clip_vit_l14_448": "image", "siglip_so400m_384": "image", "clip_vit_l14_longtext": "text"}


def _variants() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = [("dp8", {})]
    for tp in (2, 4, 8):
        out += [(f"tp{tp}", {"tp": tp}), (f"tp{tp}+sp", {"tp": tp, "sp": True})]
    out += [(f"cp{cp}", {"cp": cp}) for cp in (2, 4, 8)]
    out += [("cp2xtp2", {"cp": 2, "tp": 2}), ("cp4xtp2", {"cp": 4, "tp": 2})]
    out += [
        (f"{v}+full", {**change, "shard": "full"})
        for v, change in (("dp8", {}), ("cp2", {"cp": 2}), ("cp8", {"cp": 8}))
    ]
    out.append(("cached mb8", {"schedule": "cached", "microbatch": 8}))
    return out


def _with(plan: Plan, tower: str, change: dict[str, Any], batch: int, heads: dict[str, int]) -> Plan:
    """``plan`` with the long tower as ``change`` says; the other tower data parallel, with the least tp
    that leaves it no more replicas than rows (a batch smaller than its GPUs)."""
    towers = {}
    for name, t in plan.towers.items():
        fields = dataclasses.asdict(t)
        fields["replica_batch"] = None  # even splits at any global batch
        if name == tower:
            fields.update(tp=1, pp=1, cp=1, sp=False, schedule="gpipe", microbatch=None, recompute=False)
            fields.update(change)
        else:
            n = len(t.ranks)
            fields["tp"] = next(k for k in (1, 2, 4, 8, n) if n % k == 0 and heads[name] % k == 0 and n // k <= batch)
        towers[name] = TowerPlan(**fields)
    return Plan(plan.world_size, towers, batch)


def _fits(plan: Plan, profiles: Any, cluster: Any, batch: int, tower: str) -> tuple[bool, float]:
    """Whether the long tower's GPUs hold its step, and its busy seconds (forward, backward, exposed
    gradient sums, optimizer)."""
    cost = price_plan(plan, profiles, cluster, {"layouts": ["separate"]}, batch)
    tc = cost.towers[tower]
    return tc.memory["total"] <= cost.extra["memory_limit"], tc.busy


def _largest_batch(plan: Plan, tower: str, change: dict[str, Any], profiles: Any, cluster: Any) -> int:
    heads = {n: p.heads for n, p in profiles.items()}
    dp = max(t.dp for t in plan.towers.values())
    lo, hi = 0, dp
    while hi <= 2**20 and _fits(_with(plan, tower, change, hi, heads), profiles, cluster, hi, tower)[0]:
        lo, hi = hi, hi * 2
    while hi - lo > max(dp, 1):
        mid = (lo + hi) // 2
        if _fits(_with(plan, tower, change, mid, heads), profiles, cluster, mid, tower)[0]:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="a100_8x8")
    ap.add_argument("--global-batch", default="256,4", help="comma-separated global batches to time")
    args = ap.parse_args()
    base = load_cluster(args.cluster)
    per_node = base.devices_per_node
    cluster = base.with_world(2 * per_node)
    batches = [int(b) for b in args.global_batch.split(",")]
    print(
        f"{args.cluster}: 2 nodes x {per_node} GPUs of {cluster.device.memory / 2**30:.0f} GiB; the long tower on one node"
    )
    timed = "".join(f" {f'ms @ {b}':>11}" for b in batches)
    print(f"{'preset':<22} {'long tower':<15} {'variant':<11} {'largest batch':>13}{timed}")
    for preset, tower in PRESETS.items():
        cfg = yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text())
        profiles = model_profiles(cfg)
        other = next(n for n in profiles if n != tower)
        first, second = list(range(per_node)), list(range(per_node, 2 * per_node))
        plan = Plan(2 * per_node, {tower: TowerPlan(ranks=first), other: TowerPlan(ranks=second)})
        heads = {n: p.heads for n, p in profiles.items()}
        rows = []
        for name, change in _variants():
            try:
                largest = _largest_batch(plan, tower, change, profiles, cluster)
            except (PlanError, ValueError) as err:  # a degree the tower's heads do not allow
                rows.append((name, None, [], str(err)[:100]))
                continue
            times = []
            for b in batches:
                try:
                    fits, busy = _fits(_with(plan, tower, change, b, heads), profiles, cluster, b, tower)
                    times.append(busy if fits else None)
                except (PlanError, ValueError):  # e.g. fewer rows than replicas
                    times.append(None)
            rows.append((name, largest, times, ""))
        label = f"{tower} {profiles[tower].seq} tok"
        best = [
            min((r for r in rows if len(r[2]) > k and r[2][k] is not None), key=lambda r: r[2][k], default=None)
            for k in range(len(batches))
        ]
        for i, (name, largest, times, note) in enumerate(rows):
            head = f"{preset:<22} {label:<15}" if i == 0 else f"{'':<22} {'':<15}"
            if largest is None:
                print(f"{head} {name:<11} {'-':>13}  {note}")
                continue
            cells = ""
            for k, t in enumerate(times):
                star = "*" if best[k] is not None and best[k][0] == name else " "
                cells += f" {t * 1e3:>10.1f}{star}" if t is not None else f" {'-':>10} "
            print(f"{head} {name:<11} {largest:>13}{cells}")
    print("largest batch: the long tower's GPUs hold its step; ms: its forward + backward + exposed sums + optimizer;")
    print("* the fastest variant at that batch; -: does not fit, or fewer rows than the tower's replicas")
    _searched(args.cluster, sorted({*batches, 2}, reverse=True))  # 2 rows: fewer than a tower's GPUs


def _searched(cluster_name: str, batches: list[int]) -> None:
    """The planner's plan for each preset and batch, without and with ``sequence``."""
    import time

    from lightning_distmm.planner.search.search import make_plan

    print("\nthe planner's choice (16 GPUs), without / with planner.sequence: the long tower, the predicted step")
    print(
        f"{'preset':<22} {'batch':>6} {'sequence':<9} {'long tower (ranks dp cp tp pp shard)':<38} {'step ms':>9} {'solve s':>8}"
    )
    for preset, tower in PRESETS.items():
        cfg = yaml.safe_load((CONF_DIR / "model" / f"{preset}.yaml").read_text())
        for b in batches:
            for seq in (False, True):
                t0 = time.perf_counter()
                options = {"world_size": 16, "shards": ["none", "full"], "sequence": seq}
                plan, report = make_plan(cfg, cluster_name, b, options)
                solve = time.perf_counter() - t0
                t = plan.towers[tower]
                desc = f"{len(t.ranks)} r, dp{t.dp} cp{t.cp} tp{t.tp}{'+sp' if t.sp else ''} pp{t.pp} {t.shard}"
                print(
                    f"{preset:<22} {b:>6} {'on' if seq else 'off':<9} {desc:<38} {report.step_time * 1e3:>9.1f} {solve:>8.1f}"
                )


if __name__ == "__main__":
    main()
