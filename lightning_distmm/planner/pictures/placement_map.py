"""Pictures of a plan a person reads: the placement map (where each tower runs, and its heavy links).

:func:`placement_svg` draws a plan on its nodes: one box per node, one box per device inside it
labelled with the rank and, per tower it runs, the tower (its colour), the data-parallel replica,
the pipeline stage and the tensor-parallel shard (the stage and shard only when the tower has more
than one). The links that carry most of a step's traffic are drawn over them:

* a tensor-parallel group (two all-reduces per layer and microbatch): a dark bar under its devices,
  red and dashed where a group straddles two nodes;
* a pipeline's stage-to-stage transfers (activations forward, their gradients back): an arrow per
  tensor-parallel lane from a stage's device to the next stage's, dashed red across nodes;
* the gradient all-reduce over a tower's replicas: a dotted rail in the tower's colour under its
  devices in a node where several of its replicas meet, and a line from the node to the network
  where the sum leaves the node (its width: the bytes through that node's NIC per step).

A table under the map lists every group kind per tower (how many groups, their size, inside one
node or across nodes) and, given the planner's report (:func:`placement_map`), the bytes each
moves per step over NVLink and across nodes, as the cost model counts them. Devices that take part
in the batch-sync (every tower's last stages) carry a green dot.

The step's timeline is drawn by :func:`lightning_distmm.planner.pictures.timeline.timeline_svg` (re-exported
here). Plain SVG strings, no dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import sync_ranks
from lightning_distmm.planner.pictures.links import (
    KIND_NAMES,
    LinkGroup,
    Role,
    Traffic,
    device_roles,
    heavy_links,
    link_traffic,
)
from lightning_distmm.planner.pictures.timeline import timeline_svg

if TYPE_CHECKING:
    from lightning_distmm.planner.search.report import Report

TOWER_COLOURS = ("#4C9BE8", "#E8894C", "#6BBF59", "#9B59B6", "#D4A017", "#17BECF", "#E377C2", "#8C564B")
_INTER = "#C62828"  # a link that leaves the node
_SYNC = "#2E7D32"


def placement_map(report: Report, title: str | None = None) -> str:
    """:func:`placement_svg` of the report's chosen plan on its cluster, with the bytes per link."""
    cl = report.cluster
    if title is None:
        title = (
            f"{report.model} on {cl.name} ({cl.nodes} x {cl.devices_per_node} {cl.device.name}),"
            f" batch {report.global_batch}: where each tower runs"
        )
    return placement_svg(report.plan, cl.devices_per_node, title, link_traffic(report))


# ---------------------------------------------------------------------- drawing
_GAP, _PAD, _HEAD, _LINE, _RAILS = 8, 10, 20, 12, 18  # _RAILS: room for the TP bar and gradient rails
XY = tuple[float, float]


def placement_svg(
    plan: Plan,
    devices_per_node: int,
    title: str = "",
    traffic: Mapping[tuple[str, str], Traffic] | None = None,
    columns: int = 8,
) -> str:
    """The placement map of ``plan`` on nodes of ``devices_per_node`` (see the module's doc);
    ``traffic`` (:func:`link_traffic`) adds the bytes per link; ``columns``: devices per row
    inside a node."""
    dpn, world = devices_per_node, plan.world_size
    n_nodes = -(-world // dpn)
    cols = max(1, min(columns, dpn))
    rows = -(-dpn // cols)
    colour = {name: TOWER_COLOURS[i % len(TOWER_COLOURS)] for i, name in enumerate(plan.towers)}
    roles = device_roles(plan)
    syncing = set(sync_ranks(plan))
    links = heavy_links(plan, dpn)
    most_roles = max((len(v) for v in roles.values()), default=1) or 1
    dev_h = 16 + 2 * _LINE * most_roles + 4
    longest = max((len(r.label(plan.towers[r.tower])) for v in roles.values() for r in v), default=0)
    dev_w = max(108, round(6 * max(longest, *(len(n) for n in plan.towers)) + 12))
    node_w = 2 * _PAD + cols * dev_w + (cols - 1) * _GAP
    node_h = _HEAD + rows * (dev_h + _RAILS) + _PAD
    left, top = 10, 34
    # the gradient lines that leave a node: (node, tower) -> bytes through its NIC (None: unknown)
    leaving: dict[tuple[int, str], float | None] = {}
    for g in links:
        if g.kind == "dp" and g.inter:
            for nd in g.nodes:
                nic = None if traffic is None else traffic.get((g.tower, "dp"), Traffic()).nic.get(nd)
                leaving[(nd, g.tower)] = nic
    bus_x = left + node_w + 175
    width = bus_x + 30 if leaving else left + node_w + 20
    map_bottom = top + n_nodes * (node_h + 12)

    def box(rank: int) -> XY:
        nd, k = divmod(rank, dpn)
        row, col = divmod(k, cols)
        return (
            left + _PAD + col * (dev_w + _GAP),
            top + nd * (node_h + 12) + _HEAD + row * (dev_h + _RAILS),
        )

    parts = [
        "<defs>"
        + "".join(
            f'<marker id="{key}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" markerHeight="6"'
            f' orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="{fill}"/></marker>'
            for key, fill in (("arrow", "#222"), ("arrow-inter", _INTER))
        )
        + "</defs>",
        f'<text class="title" x="{left}" y="20" font-size="13">{escape(title)}</text>',
    ]
    for nd in range(n_nodes):
        y = top + nd * (node_h + 12)
        parts.append(
            f'<rect class="node" data-node="{nd}" x="{left}" y="{y}" width="{node_w}" height="{node_h}" rx="6"'
            f' fill="#FAFAFA" stroke="#555"/><text x="{left + 8}" y="{y + 14}" font-weight="bold">node {nd}</text>'
        )
    for rank in range(n_nodes * dpn):
        parts.append(
            _device(rank, rank // dpn, box(rank), (dev_w, dev_h), roles.get(rank, []), plan, colour, rank in syncing)
        )
    for g in links:
        parts.extend(_link(g, box, (dev_w, dev_h), colour, dpn))
    # the gradient sums that leave a node, to the network bus
    if leaving:
        parts.append(
            f'<line class="network" x1="{bus_x}" y1="{top}" x2="{bus_x}" y2="{map_bottom - 12}" stroke="#555" stroke-width="4"/>'
            f'<text x="{bus_x + 8}" y="{top + 10}" transform="rotate(90 {bus_x + 8} {top + 10})">network between nodes</text>'
        )
        most = max((b or 0.0 for b in leaving.values()), default=0.0) or 1.0
        for nd in range(n_nodes):
            mine = [(name, b) for (n, name), b in leaving.items() if n == nd]
            step = min(22.0, (node_h - _HEAD - 10) / max(len(mine), 1))
            for k, (name, b) in enumerate(mine):
                y = top + nd * (node_h + 12) + _HEAD + 10 + k * step
                w = 3.0 if b is None else 1.5 + 6.5 * b / most
                text = f"{name} gradients" + ("" if b is None else f" {_bytes(b)}")
                parts.append(
                    f'<line class="link dp inter" data-tower="{escape(name)}" data-node="{nd}" x1="{left + node_w}" y1="{y:.1f}"'
                    f' x2="{bus_x}" y2="{y:.1f}" stroke="{colour[name]}" stroke-width="{w:.1f}"/>'
                    f'<text x="{left + node_w + 6}" y="{y - 4:.1f}">{escape(text)}</text>'
                )
    body_y = map_bottom + 6
    table, body_y = _table(plan, links, traffic, left, body_y, syncing, dpn)
    legend, body_y = _legend(plan, colour, left, body_y, traffic is not None)
    parts.extend(table + legend)
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{max(width, 760)}" height="{body_y + 10}"'
        ' font-family="sans-serif" font-size="10">'
    )
    return "\n".join([head, *parts, "</svg>"])


def _device(
    rank: int, node: int, at: XY, size: XY, roles: list[Role], plan: Plan, colour: Mapping[str, str], syncs: bool
) -> str:
    (x, y), (dw, h) = at, size
    out = [f'<g class="device" data-rank="{rank}" data-node="{node}">']
    if not roles:
        out.append(
            f'<rect x="{x}" y="{y}" width="{dw}" height="{h}" fill="white" stroke="#999" stroke-dasharray="3 2"/>'
            f'<text x="{x + 4}" y="{y + 12}" fill="#999">rank {rank}: unused</text></g>'
        )
        return "".join(out)
    band = (h - 16) / len(roles)
    out.append(f'<rect x="{x}" y="{y}" width="{dw}" height="{h}" fill="white" stroke="#444"/>')
    out.append(f'<text class="rank" x="{x + 4}" y="{y + 12}">rank {rank}</text>')
    if syncs:
        out.append(f'<circle class="sync" cx="{x + dw - 8}" cy="{y + 8}" r="4" fill="{_SYNC}"/>')
    for k, role in enumerate(roles):
        by = y + 16 + k * band
        out.append(
            f'<rect x="{x + 2}" y="{by:.1f}" width="{dw - 4}" height="{band - 2:.1f}" fill="{_tint(colour[role.tower])}"/>'
            f'<text class="role" data-tower="{escape(role.tower)}" data-replica="{role.replica}" data-stage="{role.stage}"'
            f' data-shard="{role.shard}" x="{x + 5}" y="{by + 11:.1f}"><tspan font-weight="bold">{escape(role.tower)}</tspan>'
            f'<tspan x="{x + 5}" dy="{_LINE}">{role.label(plan.towers[role.tower])}</tspan></text>'
        )
    out.append("</g>")
    return "".join(out)


def _link(g: LinkGroup, box: Callable[[int], XY], size: XY, colour: Mapping[str, str], dpn: int) -> list[str]:
    dw, dev_h = size
    where = "inter" if g.inter else "intra"
    attrs = f'class="link {g.kind} {where}" data-tower="{escape(g.tower)}" data-ranks="{" ".join(map(str, g.ranks))}"'
    centre = {r: (box(r)[0] + dw / 2, box(r)[1] + dev_h / 2) for r in g.ranks}
    if g.kind == "tp":
        xs = [box(r) for r in g.ranks]
        if not g.inter and len({y for _, y in xs}) == 1:
            x0, x1, y = min(x for x, _ in xs) + 4, max(x for x, _ in xs) + dw - 4, xs[0][1] + dev_h + 4
            return [f'<line {attrs} x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#222" stroke-width="4"/>']
        pts = " ".join(f"{centre[r][0]:.1f},{centre[r][1]:.1f}" for r in g.ranks)
        return [
            f'<polyline {attrs} points="{pts}" fill="none" stroke="{_INTER}" stroke-width="3" stroke-dasharray="6 3"/>'
        ]
    if g.kind == "pp":
        a, b = g.ranks
        (ax, ay), (bx, by) = box(a), box(b)
        if ay == by:  # same row of one node: an arc over the boxes
            x0, x1 = ax + dw / 2, bx + dw / 2
            lift = 14 + abs(x1 - x0) / 12
            d = f"M{x0:.1f},{ay:.1f} Q{(x0 + x1) / 2:.1f},{ay - lift:.1f} {x1:.1f},{ay:.1f}"
        else:
            d = f"M{ax + dw / 2:.1f},{ay + dev_h:.1f} L{bx + dw / 2:.1f},{by:.1f}"
        stroke = f'stroke="{_INTER}" stroke-dasharray="6 3"' if g.inter else 'stroke="#222"'
        marker = "arrow-inter" if g.inter else "arrow"
        return [f'<path {attrs} d="{d}" fill="none" {stroke} stroke-width="2" marker-end="url(#{marker})"/>']
    # dp: a dotted rail per node and row under the group's devices there (where two or more meet)
    out = []
    for nd in g.nodes:
        here = [box(r) for r in g.ranks if r // dpn == nd]
        for y in sorted({y for _, y in here}):
            row = [x for x, yy in here if yy == y]
            if len(row) < 2:
                continue
            x0, x1, yy = min(row) + dw / 2, max(row) + dw / 2, y + dev_h + 10 + 3 * (g.lane % 3)
            out.append(
                f'<line class="link dp intra" data-tower="{escape(g.tower)}" data-node="{nd}" x1="{x0}" y1="{yy}"'
                f' x2="{x1}" y2="{yy}" stroke="{colour[g.tower]}" stroke-width="2" stroke-dasharray="2 2"/>'
            )
    return out


def _table(
    plan: Plan,
    links: list[LinkGroup],
    traffic: Mapping[tuple[str, str], Traffic] | None,
    left: float,
    y: float,
    syncing: set[int],
    dpn: int,
) -> tuple[list[str], float]:
    head = ["tower", "link", "groups", "ranks each", "where"] + (
        ["NVLink / step", "across nodes / step"] if traffic else []
    )
    rows = []
    for name in plan.towers:
        for kind in ("tp", "pp", "dp"):
            gs = [g for g in links if g.tower == name and g.kind == kind]
            if not gs:
                continue
            crossing = sum(g.inter for g in gs)
            where = f"{crossing} of {len(gs)} across nodes" if 0 < crossing < len(gs) else ""
            where = where or ("across nodes" if crossing else "inside a node")
            row = [name, KIND_NAMES[kind], str(len(gs)), str(len(gs[0].ranks)), where]
            if traffic:
                t = traffic.get((name, kind), Traffic())
                row += [_bytes(t.intra), _bytes(t.inter)]
            rows.append(row)
    nodes = sorted({r // dpn for r in syncing})
    sync_row = ["all", "batch-sync (features, loss)", "1", str(len(syncing))]
    sync_row.append("inside a node" if len(nodes) <= 1 else f"across {len(nodes)} nodes")
    rows.append(sync_row + (["", ""] if traffic else []))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    xs = [left]
    for w in widths[:-1]:
        xs.append(xs[-1] + 6.2 * w + 16)
    out = ['<g class="links-table">']
    for k, r in enumerate([head, *rows]):
        yy = y + 14 + 15 * k
        weight = ' font-weight="bold"' if k == 0 else ""
        out.extend(f'<text x="{x:.0f}" y="{yy}"{weight}>{escape(c)}</text>' for x, c in zip(xs, r))
    out.append("</g>")
    return out, y + 14 + 15 * (len(rows) + 1)


def _legend(plan: Plan, colour: Mapping[str, str], left: float, y: float, bytes_: bool) -> tuple[list[str], float]:
    out = ['<g class="legend">']
    x = left
    for name in plan.towers:
        out.append(
            f'<g class="legend-item" data-tower="{escape(name)}"><rect x="{x}" y="{y}" width="12" height="12"'
            f' fill="{_tint(colour[name])}" stroke="{colour[name]}"/><text x="{x + 16}" y="{y + 10}">{escape(name)}</text></g>'
        )
        x += 30 + 6.2 * len(name)
    out.append(
        f'<circle cx="{x + 6}" cy="{y + 6}" r="4" fill="{_SYNC}"/><text x="{x + 16}" y="{y + 10}">takes part in the batch-sync</text>'
    )
    marks = [  # (path, stroke, width, dashes, words)
        ("M0,6 H24", "#222", 4, "", "tensor-parallel group in one node"),
        ("M0,10 Q12,-2 24,10", "#222", 2, "", "stage to next stage"),
        ("M0,6 H24", "#666", 2, "2 2", "gradient all-reduce among replicas in the node"),
        ("M0,6 H24", _INTER, 3, "6 3", "a tp group or stage transfer across nodes"),
        (
            "M0,6 H24",
            "#666",
            5,
            "",
            "gradients leaving the node" + (" (width and label: bytes per step through its NIC)" if bytes_ else ""),
        ),
    ]
    for k, (d, stroke, w, dash, text) in enumerate(marks):
        yy = y + 20 + 16 * k
        out.append(
            f'<path transform="translate({left},{yy})" d="{d}" fill="none" stroke="{stroke}" stroke-width="{w}"'
            f' stroke-dasharray="{dash or "none"}"/><text x="{left + 32}" y="{yy + 10}">{escape(text)}</text>'
        )
    out.append("</g>")
    return out, y + 20 + 16 * len(marks)


def _tint(hex_colour: str, keep: float = 0.35) -> str:
    """``hex_colour`` mixed with white (``keep`` of the colour)."""
    rgb = [int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * keep):02X}" for c in rgb)


def _bytes(b: float) -> str:
    if b <= 0:
        return "0"
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


__all__ = ["Role", "LinkGroup", "Traffic", "device_roles", "heavy_links", "link_traffic", "placement_map"]
__all__ += ["placement_svg", "timeline_svg"]
