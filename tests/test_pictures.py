"""The plan pictures a person reads: the timeline's legend and time axis, the placement map's
nodes, devices, labels and links. Pure Python, no processes."""

from __future__ import annotations

import dataclasses
import math
import xml.etree.ElementTree as ET

import pytest
import yaml

from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import Backward, Forward, schedules
from lightning_distmm.planner import make_plan
from lightning_distmm.planner.cost.simulate import simulate
from lightning_distmm.planner.machine.config import CONF_DIR
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.pictures.placement_map import (
    device_roles,
    heavy_links,
    link_traffic,
    placement_map,
    placement_svg,
)
from lightning_distmm.planner.pictures.timeline import KINDS, instruction_kind, nice_ticks, timeline_svg

SVG = "{http://www.w3.org/2000/svg}"


def parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)


def find(root: ET.Element, tag: str, css: str) -> list[ET.Element]:
    """Elements ``tag`` whose class list holds every word of ``css``."""
    want = set(css.split())
    return [e for e in root.iter(SVG + tag) if want <= set(e.get("class", "").split())]


def text_of(e: ET.Element) -> str:
    return "".join(e.itertext())


# ---------------------------------------------------------------------- timeline
def pipeline_step() -> list:
    """A 3-stage cached (recomputing) image pipeline beside a one-rank text tower, in seconds."""
    plan = Plan(
        4, {"image": {"ranks": [0, 1, 2], "pp": 3, "microbatch": 2, "schedule": "cached"}, "text": {"ranks": [3]}}
    )

    def seconds(rank, ins):
        return 0.003 if isinstance(ins, Forward) else 0.006 if isinstance(ins, Backward) else 0.001

    return simulate(schedules(plan, 8), seconds, 0.0005)


def test_timeline_parses_and_keeps_its_title_and_rows():
    intervals = pipeline_step()
    root = parse(timeline_svg(intervals, "a <title> & more", note="priced, not drawn"))
    titles = find(root, "text", "title")
    assert [text_of(t) for t in titles] == ["a <title> & more"]
    rows = [text_of(t) for t in root.iter(SVG + "text") if text_of(t).startswith("rank ")]
    assert rows == [f"rank {r}" for r in range(4)]
    assert [text_of(t) for t in find(root, "text", "note")] == ["priced, not drawn"]
    labels = text_of(find(root, "text", "labels")[0])
    assert "i: image" in labels and "t: text" in labels


def test_timeline_legend_names_every_kind_drawn():
    intervals = pipeline_step()
    root = parse(timeline_svg(intervals))
    drawn = {instruction_kind(i.instruction) for i in intervals}
    assert {"Forward", "Backward", "Backward+recompute", "BatchSync", "GradSync"} == drawn
    boxes = {b.get("data-kind") for b in find(root, "rect", "box")}
    assert boxes == drawn
    items = {g.get("data-kind"): text_of(g) for g in find(root, "g", "legend-item")}
    assert set(items) == drawn | {"idle"}
    for kind in drawn:  # each entry in its colour, with its words
        assert items[kind] == KINDS[kind][1]
        swatch = next(g for g in find(root, "g", "legend-item") if g.get("data-kind") == kind).find(SVG + "rect")
        assert swatch.get("fill") == KINDS[kind][0]
    # a step without recomputation names no recomputing backward
    plain = simulate(schedules(Plan(2, {"image": {"ranks": [0]}, "text": {"ranks": [1]}}), 4), lambda r, i: 0.01)
    legend = {g.get("data-kind") for g in find(parse(timeline_svg(plain)), "g", "legend-item")}
    assert "Backward+recompute" not in legend and {"Forward", "Backward", "idle"} <= legend


def test_timeline_axis_ticks_increase_within_the_drawn_span():
    intervals = pipeline_step()
    span_ms = max(i.end for i in intervals) * 1e3
    root = parse(timeline_svg(intervals, width=900))
    axis = find(root, "g", "axis")[0]
    line = next(e for e in axis if e.tag == SVG + "line" and "tick" not in e.get("class", ""))
    x0, x1 = float(line.get("x1")), float(line.get("x2"))
    ticks = find(axis, "line", "tick")
    ms = [float(t.get("data-ms")) for t in ticks]
    xs = [float(t.get("x1")) for t in ticks]
    assert len(ticks) >= 4 and ms[0] == 0.0 and ms[-1] <= span_ms
    assert all(a < b for a, b in zip(ms, ms[1:])) and all(a < b for a, b in zip(xs, xs[1:]))
    assert x0 - 0.05 <= xs[0] and xs[-1] <= x1 + 0.05
    assert xs[0] == pytest.approx(x0, abs=0.05)
    assert (xs[-1] - x0) / (x1 - x0) == pytest.approx(ms[-1] / span_ms, abs=1e-3)  # ms scale matches the boxes
    assert "time (ms)" in text_of(axis)


@pytest.mark.parametrize("span", [0.004, 0.3, 1.0, 7.0, 52.6, 69.8, 100.0, 1234.0, 98765.0])
def test_nice_ticks_are_round_and_cover_the_span(span):
    ticks = nice_ticks(span)
    step = ticks[1] - ticks[0]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(mantissa == pytest.approx(m) for m in (1, 2, 2.5, 5))
    assert ticks[0] == 0 and ticks[-1] <= span * (1 + 1e-9) and span - ticks[-1] < step
    assert 4 <= len(ticks) <= 11
    assert all(b - a == pytest.approx(step) for a, b in zip(ticks, ticks[1:]))


# ---------------------------------------------------------------------- placement map
def two_nodes() -> Plan:
    """Node 0 (ranks 0-3): image, two replicas of tp 2; node 1 (ranks 4-7): text, two replicas of
    two pipeline stages."""
    return Plan(
        8,
        {
            "image": {"ranks": [0, 1, 2, 3], "tp": 2},
            "text": {"ranks": [4, 5, 6, 7], "pp": 2},
        },
    )


def devices(root: ET.Element) -> dict[int, ET.Element]:
    return {int(g.get("data-rank")): g for g in find(root, "g", "device")}


def roles_drawn(device: ET.Element) -> list[dict[str, str]]:
    return [
        {
            "tower": t.get("data-tower"),
            "replica": t.get("data-replica"),
            "stage": t.get("data-stage"),
            "shard": t.get("data-shard"),
            "words": text_of(t),
        }
        for t in find(device, "text", "role")
    ]


def inside(el: ET.Element, node: ET.Element) -> bool:
    """Whether a line lies inside a node's box."""
    x, y = float(node.get("x")), float(node.get("y"))
    w, h = float(node.get("width")), float(node.get("height"))
    return all(x <= float(el.get(f"x{k}")) <= x + w and y <= float(el.get(f"y{k}")) <= y + h for k in (1, 2))


def test_placement_map_has_a_box_per_node_and_a_label_per_device():
    plan = two_nodes()
    root = parse(placement_svg(plan, 4, "two nodes"))
    nodes = {int(n.get("data-node")): n for n in find(root, "rect", "node")}
    assert sorted(nodes) == [0, 1]
    devs = devices(root)
    assert sorted(devs) == list(range(8))
    for rank, g in devs.items():
        assert int(g.get("data-node")) == rank // 4
        assert [text_of(t) for t in find(g, "text", "rank")] == [f"rank {rank}"]
        assert len(roles_drawn(g)) == 1
    # the words on each device, from the plan
    expect = {
        0: ("image", "rep 0 / tp 0"),
        1: ("image", "rep 0 / tp 1"),
        2: ("image", "rep 1 / tp 0"),
        3: ("image", "rep 1 / tp 1"),
        4: ("text", "rep 0 / stage 0"),
        5: ("text", "rep 0 / stage 1"),
        6: ("text", "rep 1 / stage 0"),
        7: ("text", "rep 1 / stage 1"),
    }
    for rank, (tower, words) in expect.items():
        (role,) = roles_drawn(devs[rank])
        assert role["tower"] == tower and role["words"] == tower + words
    # and the same read back from the plan itself: replica_ranks and the tp-innermost order
    for name, t in plan.towers.items():
        for replica in range(t.dp):
            for pos, rank in enumerate(t.replica_ranks(replica)):
                (role,) = roles_drawn(devs[rank])
                assert (role["tower"], int(role["replica"])) == (name, replica)
                assert (int(role["stage"]), int(role["shard"])) == divmod(pos, t.tp)


def test_tp_shards_on_node_0_and_their_link_is_intra_node():
    plan = two_nodes()
    root = parse(placement_svg(plan, 4))
    node0 = next(n for n in find(root, "rect", "node") if n.get("data-node") == "0")
    tp = find(root, "line", "link tp")
    assert sorted(e.get("data-ranks") for e in tp) == ["0 1", "2 3"]
    for e in tp:
        assert "intra" in e.get("class").split() and e.get("data-tower") == "image"
        assert inside(e, node0)
    assert not find(root, "polyline", "link tp")  # no TP group straddles a node
    pp = find(root, "path", "link pp")
    assert sorted(e.get("data-ranks") for e in pp) == ["4 5", "6 7"]
    assert all("intra" in e.get("class").split() for e in pp)
    assert not find(root, "line", "link dp inter")  # every gradient sum stays inside its node
    table = text_of(find(root, "g", "links-table")[0])
    assert "tensor-parallel all-reduce" in table and "pipeline stage transfers" in table and "inside a node" in table


def test_a_tp_group_across_nodes_is_marked_inter_node():
    plan = Plan(8, {"image": {"ranks": [0, 1, 2, 3, 4, 5], "tp": 3}, "text": {"ranks": [6, 7]}})
    links = {(g.kind, g.ranks): g for g in heavy_links(plan, 4)}
    assert not links[("tp", (0, 1, 2))].inter and links[("tp", (3, 4, 5))].inter
    assert links[("tp", (3, 4, 5))].nodes == (0, 1)
    root = parse(placement_svg(plan, 4))
    straddling = find(root, "polyline", "link tp inter")
    assert [e.get("data-ranks") for e in straddling] == ["3 4 5"]
    assert [e.get("data-ranks") for e in find(root, "line", "link tp intra")] == ["0 1 2"]
    # the gradient sums of image (replica 0 on node 0, replica 1 on nodes 0-1) leave node 0 and 1
    leaving = find(root, "line", "link dp inter")
    assert sorted((e.get("data-tower"), e.get("data-node")) for e in leaving) == [("image", "0"), ("image", "1")]
    assert "1 of 2 across nodes" in text_of(find(root, "g", "links-table")[0])


def test_colocated_devices_carry_a_role_per_tower():
    plan = Plan(4, {"image": {"ranks": [0, 1, 2, 3], "tp": 2}, "text": {"ranks": [0, 1, 2, 3]}})
    roles = device_roles(plan)
    assert [r.tower for r in roles[3]] == ["image", "text"]
    devs = devices(parse(placement_svg(plan, 4)))
    assert [r["words"] for r in roles_drawn(devs[3])] == ["imagerep 1 / tp 1", "textrep 3"]


def test_batch_sync_devices_are_marked():
    plan = two_nodes()  # the batch-sync meets on every last stage: all of image, text's stage 1
    devs = devices(parse(placement_svg(plan, 4)))
    marked = sorted(r for r, g in devs.items() if find(g, "circle", "sync"))
    assert marked == [0, 1, 2, 3, 5, 7]


# ---------------------------------------------------------------------- from the planner's report
def report_on(nodes: int, dpn: int, model: str, batch: int, options: dict):
    cluster = load_cluster("a100_8x8")
    cluster = dataclasses.replace(cluster, nodes=nodes, devices_per_node=dpn)
    cfg = yaml.safe_load((CONF_DIR / "model" / f"{model}.yaml").read_text())
    return make_plan(cfg, cluster, batch, options)


@pytest.mark.parametrize(
    "options",
    [{"layouts": ["separate"], "tp": 2}, {"layouts": ["colocated"], "tp": 2}, {"layouts": ["colocated"], "pp": 2}],
)
def test_placement_map_of_a_report_matches_its_plan_and_its_bytes(options):
    plan, report = report_on(2, 4, "clip_vit_l14", 256, options)
    traffic = link_traffic(report)
    for name, tc in report.chosen.cost.towers.items():  # the split adds up to the report's totals
        assert sum(traffic[(name, k)].intra for k in ("tp", "pp", "dp")) == pytest.approx(tc.bytes_intra)
        assert sum(traffic[(name, k)].inter for k in ("tp", "pp", "dp")) == pytest.approx(tc.bytes_inter)
    root = parse(placement_map(report))
    assert "clip_vit_l14" in text_of(find(root, "text", "title")[0])
    assert len(find(root, "rect", "node")) == 2
    roles = device_roles(plan)
    devs = devices(root)
    assert sorted(devs) == list(range(plan.world_size))
    for rank, g in devs.items():
        drawn = [(r["tower"], int(r["replica"]), int(r["stage"]), int(r["shard"])) for r in roles_drawn(g)]
        assert drawn == [(r.tower, r.replica, r.stage, r.shard) for r in roles[rank]]
    table = text_of(find(root, "g", "links-table")[0])
    assert "NVLink / step" in table and "GB" in table
