"""A step's timeline drawn: one lane per rank, one box per instruction, coloured by kind (SVG).

It draws the intervals :mod:`lightning_distmm.planner.cost.simulate` returns (a plan's predicted step,
or the measured spans of a traced one). Pure Python, no plotting library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from lightning_distmm.core.schedule import Backward, BatchSync, Forward, Instruction, SyncPost, SyncWait
from lightning_distmm.planner.cost.simulate import Interval

# instruction kind (a backward that recomputes its forward is its own kind) -> colour, legend text
KINDS: dict[str, tuple[str, str]] = {
    "Forward": ("#4C9BE8", "forward: a microbatch through the stage"),
    "Backward": ("#E8894C", "backward"),
    "Backward+recompute": ("#C0504D", "backward, recomputing the forward first"),
    "BatchSync": ("#6BBF59", "batch-sync: features meet, loss, feature gradients"),
    "GradSync": ("#9B59B6", "gradient sync: sums over the replicas"),
    "SyncPost": ("#B5DFAA", "batch-sync gather in flight (posted, not waited for)"),
    "SyncWait": ("#3E8E2F", "batch-sync wait: loss, feature gradients"),
    # a tower consuming another's output (core/handoff_schedule.py, docs/vlm.md)
    "SendTokens": ("#F2C14E", "image tokens sent to the LLM replica owning the rows"),
    "RecvTokens": ("#D9A21B", "image tokens received"),
    "TokenLoss": ("#6BBF59", "per-token loss over the global target count"),
    "SendTokenGrads": ("#8FD3D9", "the tokens' gradient sent back"),
    "RecvTokenGrads": ("#3A9EA5", "the tokens' gradient received"),
}
_IDLE = ("#ECECEC", "idle: waiting for a stage, a peer or a sync")


def instruction_kind(ins: Instruction) -> str:
    """The kind a timeline colours ``ins`` by: its type's name, ``Backward+recompute`` for a
    backward that reruns its forward."""
    if isinstance(ins, Backward) and ins.recompute:
        return "Backward+recompute"
    return type(ins).__name__


def nice_ticks(span: float, target: int = 8) -> list[float]:
    """Ticks from 0 to ``span`` at a round spacing (1, 2, 2.5 or 5 times a power of ten), about
    ``target`` of them."""
    if span <= 0:
        return [0.0]
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    return [round(k * step, 12) for k in range(int(span / step * (1 + 1e-9)) + 1)]


def timeline_svg(
    intervals: Sequence[Interval], title: str = "", width: int = 900, row: int = 28, note: str = ""
) -> str:
    """A timeline picture (SVG) of a simulated step: one row per rank, one box per instruction
    (labelled tower initial and microbatch: ``i3`` is the image tower's microbatch 3, ``r`` when the
    backward recomputes, ``S0`` sync group 0's batch-sync), grey where the rank idles; a time axis
    in ms (the durations are seconds) and a legend of the kinds drawn; ``note`` a line under it."""
    ranks = sorted({i.rank for i in intervals})
    span = max((i.end for i in intervals), default=0.0) or 1.0
    left, top, right = 70, 30, 20
    scale = (width - left - right) / span
    axis_y = top + row * len(ranks) + 4
    kinds = [k for k in KINDS if any(instruction_kind(i.instruction) == k for i in intervals)]
    per_line = max(1, (width - left) // 290)
    legend_y = axis_y + 44
    legend_rows = (len(kinds) + 1 + per_line - 1) // per_line
    towers = sorted({i.instruction.tower for i in intervals if isinstance(i.instruction, (Forward, Backward))})
    labels = ", ".join(f"{t[0]}: {t}" for t in towers)
    labels = f"box labels: {labels}, then the microbatch (r: recomputes); S0: sync group 0's batch-sync"
    below = [labels, *([note] if note else [])]
    height = legend_y + 18 * (legend_rows + len(below)) + 6
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="10">',
        f'<text class="title" x="{left}" y="18" font-size="13">{escape(title)}</text>',
    ]
    for idx, r in enumerate(ranks):
        y = top + idx * row
        parts.append(f'<text x="4" y="{y + row / 2 + 4}">rank {r}</text>')
        parts.append(
            f'<rect class="idle" x="{left}" y="{y + 3}" width="{span * scale:.1f}" height="{row - 6}" fill="{_IDLE[0]}"/>'
        )
    for i in intervals:
        y = top + ranks.index(i.rank) * row
        ins = i.instruction
        kind = instruction_kind(ins)
        x, w = left + i.start * scale, max((i.end - i.start) * scale, 1.0)
        box_y, box_h = y + 3, row - 6
        if isinstance(ins, SyncPost):  # in flight beside the rank's compute: a thin bar under it
            box_y, box_h = y + row - 7, 4
        label, what = "", kind
        if isinstance(ins, (Forward, Backward)):
            label = f"{ins.tower[0]}{ins.mb}" + ("r" if isinstance(ins, Backward) and ins.recompute else "")
            what = f"{ins.tower} {kind.lower()} microbatch {ins.mb} ({ins.rows} rows)"
        elif isinstance(ins, BatchSync):
            label, what = f"S{ins.sync_group}", f"batch-sync of sync group {ins.sync_group}"
        elif isinstance(ins, SyncWait):
            label, what = f"W{ins.sync_group}", f"batch-sync wait of sync group {ins.sync_group}"
        elif isinstance(ins, SyncPost):
            what = f"gather of sync group {ins.sync_group} in flight"
        parts.append(
            f'<rect class="box" data-kind="{kind}" x="{x:.1f}" y="{box_y}" width="{w:.1f}" height="{box_h}"'
            f' fill="{KINDS[kind][0]}" stroke="white"><title>{escape(what)}: {i.start * 1e3:.3g}-{i.end * 1e3:.3g} ms</title></rect>'
        )
        if label and w > 14:
            parts.append(f'<text x="{x + 2:.1f}" y="{y + row / 2 + 4}" fill="white">{label}</text>')
    parts.append(
        f'<g class="axis"><line x1="{left}" y1="{axis_y}" x2="{left + span * scale:.1f}" y2="{axis_y}" stroke="black"/>'
    )
    for t in nice_ticks(span * 1e3):
        x = left + t / 1e3 * scale
        parts.append(
            f'<line class="tick" data-ms="{t:g}" x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}" stroke="black"/>'
            f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{t:g}</text>'
        )
    parts.append(f'<text x="{left + span * scale / 2:.1f}" y="{axis_y + 30}" text-anchor="middle">time (ms)</text></g>')
    parts.append('<g class="legend">')
    entries = [(k, *KINDS[k]) for k in kinds] + [("idle", *_IDLE)]
    for n, (kind, colour, text) in enumerate(entries):
        x, y = left + (n % per_line) * 290, legend_y + (n // per_line) * 18
        parts.append(
            f'<g class="legend-item" data-kind="{kind}"><rect x="{x}" y="{y - 9}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{x + 16}" y="{y + 1}">{escape(text)}</text></g>'
        )
    parts.append("</g>")
    for n, line in enumerate(below):
        css = "labels" if n == 0 else "note"
        parts.append(
            f'<text class="{css}" x="{left}" y="{legend_y + 18 * (legend_rows + n) + 4}">{escape(line)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)
