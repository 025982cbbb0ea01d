"""Every plan the schema accepts trains exactly like one process or is refused at validation.

Plans are drawn from the schema's whole space (:mod:`plan_space`: towers separate, colocated or
overlapping; dp, tp, pp, cp, sp, every shard, microbatch, schedule, recompute, uneven replica
batches; 2-4 ranks; a contrastive model and a VLM). Validation is everything the
strategy checks before it builds a process group: the plan itself (``Plan``), the plan against the
module (``check_plan_runs``, the loss's sync groups) and how the run's batch splits. A refusal is a
``PlanError`` naming the plan key; it depends only on the plan, the module's structure and the
batch size, which every rank has alike, so every rank refuses alike.

The fast test classifies a large draw without starting a process; the slow one trains a seeded
sample of the accepted plans under distmm against one process, and launches a refused one to see
the strategy stop with the same refusal. Run with ``-s`` to see the counts.
"""

from __future__ import annotations

import copy
import random
import re
from collections import Counter
from functools import cache
from typing import Any

import lightning as L
import pytest
import torch
from distmm_testing import DeepCLIP, GroupedDeepCLIP, loader, max_param_diff, read_losses, run_distmm, run_reference
from plan_space import BATCH, KINDS, draw_plan
from vlm_testing import vlm_loader

import lightning_distmm as ldm
from lightning_distmm.core.plan_schema import SCHEDULES, SHARDS, PlanError
from lightning_distmm.models.vlm import VLM, tiny_vit
from lightning_distmm.parallel.plan_checks import check_plan_runs
from lightning_distmm.plan_choice import check_loss_semantics

#: the draw the fast test classifies (plans per kind) and the seed of the slow test's sample
FAST_SEED, FAST_DRAWS = 0, 1000
SAMPLE_SEED, SAMPLE_PER_KIND = 11, 12
STEPS = 3


def make_module(kind: str, sync_groups: int) -> L.LightningModule:
    """The kind's module, seeded: a two-block ViT (4 heads) with a two-layer text tower (2 heads), or
    a two-block ViT (4 heads) feeding a two-layer Llama (4 query, 2 key/value heads); float64 for the
    VLM, so that its rounding (AdamW near eps) is not mistaken for an error."""
    L.seed_everything(0)
    if kind == "clip":
        return (GroupedDeepCLIP if sync_groups == 2 else DeepCLIP)("adamw", lr=0.01)
    vit = tiny_vit(depth=2, heads=4, qkv_bias=False)
    return VLM(vit=vit, optimizer="adamw", lr=0.01, eps=1e-6).to(torch.float64)


@cache
def _probe(kind: str, sync_groups: int) -> L.LightningModule:
    return make_module(kind, sync_groups)


def validate(data: dict[str, Any], kind: str) -> ldm.Plan:
    """What the strategy checks before any process group, in its order; raises the PlanError."""
    plan = ldm.Plan.from_dict(data)
    module = _probe(kind, plan.sync_groups)
    towers = module.tower_specs()
    check_plan_runs(plan, towers)
    check_loss_semantics(plan, module)
    plan.check_batch_split(BATCH[kind])
    return plan


def reason(err: PlanError) -> str:
    """The refusal's key (tower names as ``*``) and the rule's first words (numbers as N)."""
    key = re.sub(r"^towers\.[^.]+", "towers.*", err.key or "?")
    text = re.sub(r"^tower '[^']+'(, [a-z]+=(\d+|'[a-z0-9]+'))*(, sp: true)?(, schedule '[a-z]+')?: ", "", str(err))
    text = re.sub(r"shard: [a-z0-9]+", "shard: <kind>", re.sub(r"\[[^\]]*\]", "[..]", text))
    words = " ".join(re.sub(r"\b\d+\b", "N", text).split()[:7])
    return f"{key}: {words}"


def names_its_key(err: PlanError, data: dict[str, Any]) -> bool:
    """The message names the key: its last part (``sp``, ``ranks``...) and, under ``towers.<name>``,
    the tower."""
    if not err.key:
        return False
    parts = err.key.split(".")
    tower_ok = len(parts) < 2 or parts[0] != "towers" or parts[1] in str(err)
    return parts[-1] in str(err) and tower_ok


def draw(seed: int, kind: str, n: int) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-{kind}")
    return [draw_plan(rng, kind) for _ in range(n)]


def features(data: dict[str, Any], kind: str) -> set[str]:
    """What a plan exercises, for the coverage check."""
    towers = list(data["towers"].values())
    ranks = [set(t["ranks"]) for t in towers]
    out = {f"kind={kind}", f"world={data['world_size']}"}
    out.add("colocated" if all(r == ranks[0] for r in ranks) else "separate" if not ranks[0] & ranks[1] else "overlap")
    for t in towers:
        out |= {k for k in ("tp", "pp", "cp", "sp", "microbatch", "recompute", "replica_batch") if t.get(k)}
        out |= {f"shard={t.get('shard', 'none')}", f"schedule={t.get('schedule', 'gpipe')}"}
        width = t.get("tp", 1) * t.get("pp", 1) * t.get("cp", 1)
        if len(t["ranks"]) // width > 1:
            out.add("dp")
    return out


def test_drawn_plans_are_accepted_or_refused_naming_the_key(capsys):
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    covered: set[str] = set()
    bad: list[str] = []
    for kind in KINDS:
        for data in draw(FAST_SEED, kind, FAST_DRAWS):
            try:
                validate(data, kind)
            except PlanError as err:
                counts["refused"] += 1
                reasons[reason(err)] += 1
                if not names_its_key(err, data):
                    bad.append(f"{data}: [{err.key}] {err}")
                continue
            counts[f"accepted {kind}"] += 1
            covered |= features(data, kind)
    with capsys.disabled():
        print(f"\nplan space, seed {FAST_SEED}: {2 * FAST_DRAWS} plans drawn, {dict(counts)}; refused by reason:")
        for why, n in reasons.most_common():
            print(f"  {n:4d}  {why}")
    assert not bad, "refusals that do not name their key:\n" + "\n".join(bad)
    every = {f"kind={k}" for k in KINDS} | {f"world={w}" for w in (2, 3, 4)}
    every |= {"colocated", "separate", "overlap", "dp", "tp", "pp", "cp", "sp", "microbatch", "recompute"}
    every |= {"replica_batch"} | {f"shard={s}" for s in SHARDS} | {f"schedule={s}" for s in SCHEDULES}
    assert every <= covered, f"the accepted plans never exercise {sorted(every - covered)}"


def _sample(seed: int) -> tuple[list[tuple[str, dict[str, Any]]], tuple[str, dict[str, Any], PlanError] | None]:
    """The first SAMPLE_PER_KIND accepted plans of each kind in the seeded draw, and the first plan
    refused by a module rule (the plan alone validates)."""
    accepted: list[tuple[str, dict[str, Any]]] = []
    refused = None
    for kind in KINDS:
        mine = 0
        for data in draw(seed, kind, 200):
            try:
                validate(data, kind)
            except PlanError as err:
                if refused is None and _plan_alone_validates(data):
                    refused = (kind, data, err)
                continue
            accepted.append((kind, data))
            mine += 1
            if mine == SAMPLE_PER_KIND:
                break
    return accepted, refused


def _plan_alone_validates(data: dict[str, Any]) -> bool:
    try:
        ldm.Plan.from_dict(data)
    except PlanError:
        return False
    return True


def weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest difference of two modules' weights, in float64 (float64 weights keep their digits)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def _data(kind: str) -> Any:
    return loader(BATCH[kind]) if kind == "clip" else vlm_loader(BATCH[kind], dtype=torch.float64)


@pytest.mark.slow
def test_a_seeded_sample_of_accepted_plans_trains_exactly(tmp_path, capsys):
    accepted, refused = _sample(SAMPLE_SEED)
    references: dict[tuple[str, int], tuple[Any, Any, list[float]]] = {}
    wrong: list[str] = []
    worst: dict[str, float] = {}
    for i, (kind, data) in enumerate(accepted):
        plan = ldm.Plan.from_dict(data)
        key = (kind, plan.sync_groups)
        if key not in references:
            initial = make_module(*key)
            reference = copy.deepcopy(initial)
            run_reference(reference, _data(kind), STEPS, str(tmp_path / f"ref-{kind}{key[1]}.json"))
            references[key] = (initial, reference, read_losses(tmp_path / f"ref-{kind}{key[1]}.json"))
        initial, reference, losses = references[key]
        module = copy.deepcopy(initial)
        run_distmm(module, plan, plan.world_size, _data(kind), STEPS, str(tmp_path / f"dist{i}.json"))
        # float32: 1e-5, as every exactness test; float64: 1e-9 (the logged losses are float32 either way)
        tol = 1e-5 if kind == "clip" else 1e-9
        diff = weight_diff(reference, module)
        got = read_losses(tmp_path / f"dist{i}.json")
        if diff > tol or got != pytest.approx(losses, abs=1e-5) or max_param_diff(reference, initial) < 1e-3:
            wrong.append(f"{kind} {data}: weights {diff:.2e} apart, losses {got} vs {losses}")
        worst[kind] = max(worst.get(kind, 0.0), diff)
    with capsys.disabled():
        print(
            f"\nplan space sample, seed {SAMPLE_SEED}: {len(accepted)} plans trained, {len(wrong)} not exact;"
            f" largest weight difference {', '.join(f'{k} {v:.1e}' for k, v in worst.items())}"
        )
    assert len(accepted) == len(KINDS) * SAMPLE_PER_KIND
    assert not wrong, "\n".join(wrong)
    # a plan refused by a module rule stops the launched run with the same refusal
    assert refused is not None
    kind, data, err = refused
    plan = ldm.Plan.from_dict(data)
    module = make_module(kind, plan.sync_groups)
    with pytest.raises(Exception) as raised:
        run_distmm(module, plan, plan.world_size, _data(kind), 1, str(tmp_path / "refused.json"))
    assert str(err) in str(raised.value), (str(err), str(raised.value)[-2000:])


# ---------------------------------------------------------------------- what the planner can emit
#: the contrastive presets, clusters and global batches whose every tower choice is checked
PLANNER_MODELS = ("clip_vit_b32", "clip_vit_l14_448", "lit_l16_bert_large", "coca_vit_l14", "siglip_so400m_384")
PLANNER_CLUSTERS = ("a100_8x8", "dgx_h100")
PLANNER_BATCHES = (256, 4096)


def profile_refusal(profile: Any, tower: Any) -> str | None:
    """The module rules of ``check_plan_runs`` asked of a preset's profile (heads, layers, kind of
    tower), for towers too big to build here; None when the tower plan passes them."""
    from lightning_distmm.planner.search.sequence import CP_ARCHS

    if profile.heads % (tower.tp * tower.cp):
        return f"{profile.heads} heads do not divide by cp*tp = {tower.cp * tower.tp}"
    if (tower.cp > 1 or tower.sp) and profile.arch not in CP_ARCHS:
        return f"cp / sp on a {profile.arch} tower"
    if tower.pp > profile.layers:
        return f"{profile.layers} layers cut into pp={tower.pp} stages"
    return None


@pytest.mark.slow  # no process, but 13 s of enumeration: the suite runs it, the fast lane does not
def test_every_tower_plan_the_planner_can_emit_validates(capsys):
    """Every configuration the search may choose for a tower of a preset (each tp, pp, cp, sp,
    shard, schedule, microbatch and replica count ``tower_candidates`` keeps, with ``planner.sequence``
    on and recomputation allowed) is a tower plan that validates and passes the module's rules."""
    import yaml

    from lightning_distmm.planner.cost.plans import tower_plan
    from lightning_distmm.planner.machine.config import CONF_DIR
    from lightning_distmm.planner.measure.local import load_cluster
    from lightning_distmm.planner.options import PlannerOptions
    from lightning_distmm.planner.profiles.profile import model_profiles
    from lightning_distmm.planner.search.partition import tower_candidates
    from lightning_distmm.planner.search.search import search_job

    opts = PlannerOptions.from_any({"schedules": list(SCHEDULES), "recompute": True, "sequence": True})
    checked, bad = Counter(), []
    for name in PLANNER_MODELS:
        profiles = model_profiles(yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text()))
        for cluster in PLANNER_CLUSTERS:
            spec = load_cluster(cluster)
            for batch in PLANNER_BATCHES:
                job = search_job(profiles, spec, batch, opts)
                for tower, profile in profiles.items():
                    candidates = tower_candidates(profile, job)
                    for i in range(len(candidates)):
                        choice = candidates.choice(i)
                        try:
                            plan_tower = tower_plan(choice, list(range(choice.n)))
                            ldm.Plan(choice.n, {tower: plan_tower}, batch)
                            why = profile_refusal(profile, plan_tower)
                        except (PlanError, ValueError) as err:
                            why = str(err)
                        checked[f"tp{choice.tp} pp{choice.pp} cp{choice.cp} {choice.shard}"] += 1
                        if why:
                            bad.append(f"{name} {cluster} batch {batch} {tower}: {choice}: {why}")
    with capsys.disabled():
        print(f"\nplanner: {sum(checked.values())} tower choices of {len(PLANNER_MODELS)} presets checked")
    assert sum(checked.values()) > 1000 and not bad, "\n".join(bad[:20])


@pytest.mark.slow  # no process, but 9 s of pricing
def test_every_module_choice_of_the_encoder_llm_planner_validates(capsys):
    """The VLM planner's grid (``module_options``: each tp, pp, shard, recompute and
    microbatch count of a module on 1..N devices) for its presets: every choice, as the tower plan
    ``simulate_step`` writes, validates and passes the module's rules."""
    from lightning_distmm.planner.cost import CostOptions
    from lightning_distmm.planner.measure.local import load_cluster
    from lightning_distmm.planner.vlm.partition import module_options
    from lightning_distmm.planner.vlm.profile import WORKLOADS, vlm_profiles

    checked, bad = 0, []
    for workload in WORKLOADS.values():
        profs = vlm_profiles(workload)
        for cluster in ("a100_8x8",):
            spec = load_cluster(cluster)
            for batch in (128, 1000):
                for module, profile in (("image", profs.vision), ("llm", profs.llm)):
                    for n in range(1, spec.world_size + 1):
                        for mc in module_options(profs, module, n, batch, spec, CostOptions()):
                            c = mc.choice
                            tower = ldm.TowerPlan(
                                ranks=list(range(n)),
                                tp=c.tp,
                                pp=c.pp,
                                microbatch=-(-mc.rows // min(c.microbatches, mc.rows)),
                                shard=c.shard,
                                recompute=c.recompute,
                            )
                            other = "llm" if module == "image" else "image"
                            try:
                                ldm.Plan(n + 1, {module: tower, other: {"ranks": [n]}}, batch)
                                why = profile_refusal(profile, tower)
                            except PlanError as err:
                                why = str(err)
                            checked += 1
                            if why:
                                bad.append(f"{workload.preset} {cluster} batch {batch}: {c}: {why}")
    with capsys.disabled():
        print(f"\nVLM planner: {checked} module choices checked")
    assert checked > 1000 and not bad, "\n".join(bad[:20])
