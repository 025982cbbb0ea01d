"""Context parallelism (cp) per tower: the plan's rules, and training equal to one process."""

import pytest
from distmm_testing import DeepCLIP, TinyCLIP, TinyText, compare_with_reference
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import lightning_distmm as ldm
from lightning_distmm.core import Plan, PlanError, TowerPlan
from lightning_distmm.core.schedule import stage_neighbours, sync_ranks
from lightning_distmm.parallel.families import check_cp, check_sp


def test_cp_and_sp_round_trip_through_yaml_and_show_in_the_table():
    plan = Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "tp": 2}, "text": {"ranks": [0, 1], "tp": 2, "sp": True}})
    again = Plan.from_yaml(plan.to_yaml())
    assert again == plan and again.towers["image"].cp == 2 and again.towers["text"].sp
    rows = {line.split()[0]: line.split() for line in plan.table().splitlines()[2:]}
    head = plan.table().splitlines()[1].split()
    assert rows["image"][head.index("cp")] == "2" and rows["image"][head.index("tp")] == "2"
    assert rows["text"][head.index("cp")] == "1" and rows["text"][head.index("tp")] == "2+sp"


def test_rank_layout_with_cp():
    """A replica is pp stages of cp*tp ranks (tp innermost): the cp ranks of a stage share its rows,
    the next stage's peer keeps the (cp, tp) coordinate, the features come from the first rank of the last stage."""
    tower = TowerPlan(ranks=list(range(16)), cp=2, tp=2, pp=2)
    assert tower.dp == 2 and tower.stage_width == 4 and tower.replica_ranks(1) == list(range(8, 16))
    assert tower.replica_of(7) == 0 and tower.feature_rank(1) == 12
    plan = Plan(16, {"image": tower})
    assert stage_neighbours(plan, "image", 3) == (0, 0, None, 7)
    assert stage_neighbours(plan, "image", 14) == (1, 1, 10, None)
    assert sync_ranks(plan) == (4, 5, 6, 7, 12, 13, 14, 15)


@pytest.mark.parametrize(
    "tower, message",
    [
        ({"ranks": [0, 1, 2], "cp": 2}, r"tower 'image': 3 ranks do not divide into replicas of cp\*tp\*pp = 2\*1\*1"),
        ({"ranks": [0, 1, 2], "cp": 0}, r"towers.image.cp: expected a positive int, got 0"),
        ({"ranks": [0, 1, 2], "sp": "yes"}, r"towers.image.sp: expected true or false"),
        ({"ranks": [0, 1, 2], "sp": True}, r"tower 'image': sp: true .* needs tp > 1 \(this tower has tp=1\)"),
        ({"ranks": [0, 1], "cp": 2, "shard": "hybrid"}, r"tower 'image': cp=2 with shard: hybrid is not supported"),
    ],
)
def test_plan_rules_name_the_tower_and_the_rule(tower, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict({"world_size": len(tower["ranks"]), "towers": {"image": tower}})
    if tower.get("cp", 1) >= 1 and isinstance(tower.get("sp", False), bool):  # built in Python too
        with pytest.raises(PlanError, match=message.split(":")[0].replace("towers.image.", "")):
            Plan(len(tower["ranks"]), {"image": TowerPlan(**tower)})


def _vit(heads: int = 4, **kw) -> VisionTransformer:
    return VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=heads, num_classes=8, **kw)


@pytest.mark.parametrize(
    "module, cp, tp, pp, message",
    [
        (
            _vit(4),
            8,
            1,
            1,
            r"tower 'x', cp=8: blocks.0.attn has 4 attention heads, which do not divide by cp\*tp = 8\*1",
        ),
        (_vit(4), 2, 4, 1, r"do not divide by cp\*tp = 2\*4 = 8"),
        (TinyText(), 4, 1, 1, r"encoder.layers.0.self_attn has 2 attention heads"),
        (_vit(4, dynamic_img_size=True), 2, 1, 1, "dynamic image sizes and patch dropout"),
        (_vit(4, patch_drop_rate=0.5), 2, 1, 1, "dynamic image sizes and patch dropout"),
        (nn.Linear(2, 2), 2, 1, 1, r"tower 'x', cp=2: no context-parallel plan for a Linear tower"),
    ],
)
def test_module_checks_name_the_tower_and_the_rule(module, cp, tp, pp, message):
    with pytest.raises(ValueError, match=message):
        check_cp(module, cp, tp, "x", pp)
    if "heads" in message:
        check_cp(module, 2 if cp > 2 else 1, 1, "x", 1)  # a divisor passes


CP_PLANS = {
    # TinyCLIP's ViT has 5 tokens (class + 4 patches): cp=2 pads them to 6 and masks the padded key
    "image-cp2+text1": (TinyCLIP, ldm.Plan(3, {"image": {"ranks": [0, 1], "cp": 2}, "text": {"ranks": [2]}})),
    "image-cp2-shard-full+text1": (
        TinyCLIP,
        ldm.Plan(3, {"image": {"ranks": [0, 1], "cp": 2, "shard": "full"}, "text": {"ranks": [2]}}),
    ),
    "image-dp2xcp2-shard-full+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "shard": "full"}, "text": {"ranks": [0]}}),
    ),
    "image-dp2xcp2+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "replica_batch": [5, 3]}, "text": {"ranks": [0]}}, 8),
    ),
    "image-cp2xpp2+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "pp": 2, "microbatch": 4}, "text": {"ranks": [0]}}),
    ),
    # a pipelined text tower: the second stage takes the length from the whole-sequence mask it builds
    "text-cp2xpp2+image-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0]}, "text": {"ranks": [0, 1, 2, 3], "cp": 2, "pp": 2, "microbatch": 4}}),
    ),
    # padded captions (lengths 2..5 of 6): the causal and padding masks span the split, EOS pooling after the gather
    "text-cp2+image1": (TinyCLIP, ldm.Plan(3, {"image": {"ranks": [2]}, "text": {"ranks": [0, 1], "cp": 2}})),
    # 5 image tokens over 4 ranks: padded to 8, rank 3 holds padding only
    "image-cp4+text-cp2": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 4}, "text": {"ranks": [0, 1], "cp": 2}}),
    ),
    # 5 tokens over tp=2: padded to 6; the norms, embeddings and head see 3 tokens per rank
    "image-tp2+sp+text1": (
        TinyCLIP,
        ldm.Plan(3, {"image": {"ranks": [0, 1], "tp": 2, "sp": True}, "text": {"ranks": [2]}}),
    ),
    # microbatches of 7 and 1 rows: at one row the position embedding's gradient is the stream's own
    # tensor (nothing to sum over the batch), which sp's tp sum of that gradient must not change in place
    "image-tp2+sp-one-row-microbatch+text-colocated": (
        TinyCLIP,
        ldm.Plan(2, {"image": {"ranks": [0, 1], "tp": 2, "sp": True, "microbatch": 7}, "text": {"ranks": [0, 1]}}),
    ),
    "image-dp2xtp2+sp+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2, "sp": True}, "text": {"ranks": [0]}}),
    ),
    # the gradient cache replays the forward (and its all-to-alls) in backward; recompute likewise per block
    "image-cp2-cached+text-cp2-recompute": (
        TinyCLIP,
        ldm.Plan(
            4,
            {
                "image": {"ranks": [0, 1], "cp": 2, "microbatch": 3, "schedule": "cached"},
                "text": {"ranks": [2, 3], "cp": 2, "recompute": True},
            },
        ),
    ),
    "image-cp2xtp2+text-colocated": (
        DeepCLIP,
        ldm.Plan(4, {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "tp": 2}, "text": {"ranks": [0]}}),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", list(CP_PLANS))
def test_context_parallel_towers_are_exact(name, optimizer, tmp_path):
    cls, plan = CP_PLANS[name]
    lr = 0.05 if optimizer == "sgd" else 0.01
    compare_with_reference(lambda: cls(optimizer, lr=lr), plan, plan.world_size, 8, 3, tmp_path).assert_exact()


class ShortText(TinyText):
    """TinyText on the first 5 of the 6 tokens (every caption is at most 5 long): 5 does not divide by
    cp=2, so a pipelined tower pads its sequence and its later stages must be told the length."""

    def forward(self, input_ids, attention_mask):  # type: ignore[no-untyped-def]
        return super().forward(input_ids[:, :5], attention_mask[:, :5])

    def pipeline_stages(self, pp: int) -> list:
        from lightning_distmm.parallel.pipeline import Stage

        def short(run):  # type: ignore[no-untyped-def]
            return lambda x, rows: run(x, {k: v[:, :5] if k != "image" else v for k, v in rows.items()})

        return [Stage(st.modules, short(st.run), st.extra) for st in super().pipeline_stages(pp)]


class ShortDeepCLIP(DeepCLIP):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.text = ShortText(layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("split, optimizer", [("cp", "sgd"), ("cp", "adamw"), ("sp", "adamw")])
def test_pipelined_text_tower_pads_its_sequence(split, optimizer, tmp_path):
    """5 tokens over cp=2 (or tp=2 with sp) in a text tower cut in pp=2 stages: padded to 6 on the
    first stage; the second receives 3-token chunks and takes the whole length (5) from the batch
    rows, masks the padded key and drops the padding before EOS pooling. (sp: AdamW only, as for the
    unpipelined text sp case's reason at SGD's larger steps.)"""
    way = {"cp": 2} if split == "cp" else {"tp": 2, "sp": True}
    plan = ldm.Plan(4, {"image": {"ranks": [0]}, "text": {"ranks": [0, 1, 2, 3], **way, "pp": 2, "microbatch": 4}})
    lr = 0.05 if optimizer == "sgd" else 0.01
    compare_with_reference(lambda: ShortDeepCLIP(optimizer, lr=lr), plan, 4, 8, 3, tmp_path).assert_exact()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_text_tower_with_tp2_and_sp_is_exact(optimizer, tmp_path):
    """Padded captions (lengths 2..5 of 6) over tp=2 with sp: the causal and padding masks span the
    split, EOS pooling after the gather; the embeddings, LayerNorms and projection see 3 tokens per
    rank. SGD at lr 0.01: at the 0.05 of the image cases TinyCLIP's parameters move by 7 in 3 steps
    and a text tower's TP summation order alone (tp2 without sp, as with it) ends 1.6e-5 apart."""
    plan = ldm.Plan(3, {"image": {"ranks": [2]}, "text": {"ranks": [0, 1], "tp": 2, "sp": True}})
    compare_with_reference(lambda: TinyCLIP(optimizer, lr=0.01), plan, 3, 8, 3, tmp_path).assert_exact()


@pytest.mark.parametrize(
    "module, message",
    [
        (
            nn.Linear(2, 2),
            r"tower 'x', tp=2, sp: true: no sequence-parallel plan for a Linear tower: supported are timm"
            r" VisionTransformer, transformers CLIP-style text encoders",
        ),
        (_vit(4, patch_drop_rate=0.5), "patch dropout"),
    ],
)
def test_sp_checks_name_the_tower_and_the_rule(module, message):
    with pytest.raises(ValueError, match=message):
        check_sp(module, "x", 2)
    check_sp(_vit(4), "x", 2)
    check_sp(TinyText(), "x", 2)  # a CLIP-style text tower splits its sequence too


@pytest.mark.parametrize(
    "tower, message",
    [
        ({"tp": 2, "sp": True, "shard": "full"}, r"tower 'image': sp: true with shard: full is not supported"),
        ({"tp": 2, "sp": True, "shard": "zero2"}, r"tower 'image': sp: true with shard: zero2 is not supported"),
        ({"tp": 2, "sp": True, "cp": 2}, r"tower 'image': sp: true with cp=2 is not supported"),
    ],
)
def test_sp_with_cp_or_sharding_is_refused_by_the_plan(tower, message):
    """What sp cannot run with is the plan's own rule: refused when the plan is made, naming the key."""
    with pytest.raises(PlanError, match=message) as refused:
        Plan(4, {"image": {"ranks": [0, 1, 2, 3], **tower}})
    assert refused.value.key == "towers.image.sp"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["image-dp2xcp2+text-colocated", "image-cp2xtp2+text-colocated", "image-tp2+sp+text1"])
def test_clipping_counts_each_gradient_once(name):
    """The global norm counts a cp group's (summed, identical) gradients once and sp's summed copies once."""
    import tempfile
    from pathlib import Path

    cls, plan = CP_PLANS[name]
    with tempfile.TemporaryDirectory() as tmp:
        compare_with_reference(
            lambda: cls("sgd", lr=0.05), plan, plan.world_size, 8, 3, Path(tmp), gradient_clip_val=0.05
        ).assert_exact()


@pytest.mark.slow
def test_the_distmm_schedule_with_cp_and_pp_is_exact_for_its_grouped_loss(tmp_path):
    """DistMM-Pipe's two sync groups through an image tower of 2 stages x 2 cp ranks, text with cp2."""
    from distmm_testing import GroupedDeepCLIP

    grouped = {"microbatch": 2, "schedule": "distmm"}
    plan = ldm.Plan(
        4,
        {"image": {"ranks": [0, 1, 2, 3], "cp": 2, "pp": 2, **grouped}, "text": {"ranks": [0, 1], "cp": 2, **grouped}},
    )
    compare_with_reference(lambda: GroupedDeepCLIP("adamw", lr=0.01), plan, 4, 10, 2, tmp_path).assert_exact()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["image-tp2+sp+text1", "image-cp2+text1"])
def test_towers_built_on_meta_train_like_one_process(name, tmp_path):
    """``trainer.init_module(empty_init=True)``: the tower is prepared on meta and materialised after,
    with new Parameter objects; sp's tp sums must reach them (they are put on before each forward)."""
    import lightning as L
    from distmm_testing import LossRecorder, loader, max_param_diff, read_losses, run_reference, trainer_kwargs

    cls, plan = CP_PLANS[name]
    L.seed_everything(0)
    reference = cls("sgd", lr=0.05)
    run_reference(reference, loader(8), 3, str(tmp_path / "ref.json"))
    trainer = L.Trainer(
        devices=plan.world_size,
        max_steps=3,
        strategy=ldm.DistMMStrategy(plan=plan, start_method="fork"),
        callbacks=[LossRecorder(str(tmp_path / "dist.json"))],
        **trainer_kwargs(),
    )
    L.seed_everything(0)
    with trainer.init_module(empty_init=True):
        module = cls("sgd", lr=0.05)
    assert module.visual.blocks[0].norm1.weight.is_meta
    trainer.fit(module, loader(8))
    assert max_param_diff(reference, module) <= 1e-5
    assert read_losses(tmp_path / "dist.json") == pytest.approx(read_losses(tmp_path / "ref.json"), abs=1e-5)


def _tower_gradients_match(rank: int, world: int, port: int, kw: dict, out) -> None:  # type: ignore[no-untyped-def]
    """One forked rank: the ViT ``kw`` split over ``world`` cp ranks against the same ViT whole."""
    import copy
    import os

    import torch
    import torch.distributed as dist

    from lightning_distmm.parallel.context_parallel import feature_grad_scale
    from lightning_distmm.parallel.families import apply_cp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=1, num_heads=4, num_classes=8, **kw)
        whole = copy.deepcopy(model)
        images, grad = torch.randn(3, 3, 8, 8), torch.randn(3, 8)
        expected = whole(images)
        expected.backward(grad)
        apply_cp(model, dist.group.WORLD, world, rank)
        got = model(images)
        got.backward(feature_grad_scale(grad, world))
        worst = (got - expected).abs().max().item()
        for (_, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
            dist.all_reduce(p.grad)  # the runtime's sum over the cp ranks
            worst = max(worst, (p.grad - q.grad).abs().max().item())
        out.put((rank, worst))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        {"reg_tokens": 2},  # class + 2 register tokens + 4 patches = 7, padded to 8
        {"class_token": False, "global_pool": "map"},  # SigLIP's attention-pool head, 4 tokens
        {"class_token": False, "reg_tokens": 1, "no_embed_class": True, "global_pool": "avg"},
    ],
    ids=["registers", "map-head", "avg-pool"],
)
def test_prefix_tokens_and_pooling_heads_are_exact_over_four_cp_ranks(kw):
    import multiprocessing as mp

    from ports import free_port

    port = free_port()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tower_gradients_match, args=(r, 4, port, kw, out)) for r in range(4)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(results) == [0, 1, 2, 3] and max(results.values()) < 1e-5, results
