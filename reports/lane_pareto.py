"""Accuracy against DSP throughput for the lane assignments `ptq tune --scheme int4-dsp` measured
(`ptq.tuning.lane_tuner`): the Pareto front as an SVG (for `ptq dsp-report --tune`) and the per-layer text.

A point is (MACs per DSP per cycle, validation cosine); it is on the Pareto front when no other point has at
least its throughput and at least its cosine with one of them strictly more. The SVG draws every point
(grey), the front as a line through its points (blue), the target cosine as a dashed line and the chosen
assignment ringed; axes in data units, the cosine axis from the lowest point, or from 1 - 2 (1 - target) when
points lie further below (those are drawn hollow on the axis, their values in their tooltips). `lanes_html` is the same figure with
the points and layers as tables, for report.html (`ptq report --tune`).
"""
from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Optional, Sequence

W, H = 560, 320
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 24, 48
FRONT, OTHER, CHOSEN, TARGET = "#1c5fd1", "#9a9a9a", "#d11c1c", "#2a8a2a"


def pareto_front(points: Sequence[dict]) -> list[dict]:
    """The non-dominated points (by throughput and cosine), by throughput ascending."""
    front = []
    for p in points:
        dominated = any(q["throughput"] >= p["throughput"] and q["cosine"] >= p["cosine"]
                        and (q["throughput"] > p["throughput"] or q["cosine"] > p["cosine"]) for q in points)
        if not dominated and not any(q["throughput"] == p["throughput"] and q["cosine"] == p["cosine"] for q in front):
            front.append(p)
    return sorted(front, key=lambda p: p["throughput"])


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    step = (hi - lo) / count
    return [lo + k * step for k in range(count + 1)]


def pareto_svg(points: Sequence[dict], chosen: Optional[dict] = None, target: Optional[float] = None,
               title: str = "") -> str:
    """The <svg> of the points (dicts with `throughput`, `cosine`, `label`), their front, the chosen one and
    the target cosine."""
    if not points:
        raise ValueError("no lane assignment to draw")
    xs = [p["throughput"] for p in points]
    x_lo, x_hi = min(xs + [2.0]) - 0.1, max(xs + [4.0]) + 0.1
    y_hi = 1.0
    y_lo = min(p["cosine"] for p in points)
    if target is not None:
        y_lo = max(min(y_lo, target), 1 - 2 * (1 - target)) if y_lo < target else min(y_lo, target)
    y_lo = max(min(y_lo, 0.999), -1.0)
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def sy(y: float) -> float:
        return TOP + (y_hi - max(y, y_lo)) / (y_hi - y_lo) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="pareto" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" role="img" aria-label="cosine against DSP throughput" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#999"/>']
    if title:
        parts.append(f'<text x="{LEFT}" y="{TOP - 8}">{escape(title)}</text>')
    for x in _ticks(x_lo, x_hi):
        parts.append(f'<line x1="{sx(x):.1f}" y1="{TOP + plot_h}" x2="{sx(x):.1f}" y2="{TOP + plot_h + 4}" '
                     f'stroke="#999"/><text x="{sx(x):.1f}" y="{TOP + plot_h + 16}" '
                     f'text-anchor="middle">{x:.2f}</text>')
    for y in _ticks(y_lo, y_hi):
        parts.append(f'<line x1="{LEFT}" y1="{sy(y):.1f}" x2="{LEFT + plot_w}" y2="{sy(y):.1f}" stroke="#e6e6e6"/>'
                     f'<text x="{LEFT - 4}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:.4f}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{H - 10}" text-anchor="middle">MACs per DSP per cycle</text>'
                 f'<text x="14" y="{TOP + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {TOP + plot_h / 2})">logits cosine</text>')
    if target is not None:
        parts.append(f'<line class="target" x1="{LEFT}" y1="{sy(target):.1f}" x2="{LEFT + plot_w}" '
                     f'y2="{sy(target):.1f}" stroke="{TARGET}" stroke-dasharray="5,4"/>'
                     f'<text x="{LEFT + plot_w - 4}" y="{sy(target) - 4:.1f}" text-anchor="end" fill="{TARGET}">'
                     f'target {target:g}</text>')
    front = pareto_front(points)
    path = " ".join(f"{sx(p['throughput']):.1f},{sy(p['cosine']):.1f}" for p in front)
    parts.append(f'<polyline class="front" points="{path}" fill="none" stroke="{FRONT}" stroke-width="1.5"/>')
    on_front = {id(p) for p in front}
    for p in points:
        color = FRONT if id(p) in on_front else OTHER
        fill = f'fill="{color}"' if p["cosine"] >= y_lo else f'fill="none" stroke="{color}"'  # below: on the axis
        parts.append(f'<circle class="point" cx="{sx(p["throughput"]):.1f}" cy="{sy(p["cosine"]):.1f}" r="3.5" '
                     f'{fill}><title>{escape(p["label"])}: {p["throughput"]:.3f} MACs/DSP/cycle, '
                     f'cosine {p["cosine"]:.5f}</title></circle>')
    if chosen is not None:
        parts.append(f'<circle class="chosen" cx="{sx(chosen["throughput"]):.1f}" cy="{sy(chosen["cosine"]):.1f}" '
                     f'r="7" fill="none" stroke="{CHOSEN}" stroke-width="2"/>'
                     f'<text x="{sx(chosen["throughput"]) + 9:.1f}" y="{sy(chosen["cosine"]) + 14:.1f}" '
                     f'fill="{CHOSEN}">tuned {chosen["throughput"]:.2f}, {chosen["cosine"]:.4f}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _value(value: Optional[float]) -> str:
    """A per-layer figure, "-" where it was not measured (a 16-bit layer's sensitivity, gains without a 16-bit step)."""
    return "-" if value is None else f"{value:.6f}"


def _layer_columns(lanes: dict) -> list[tuple[str, str]]:
    """(heading, key) of the per-layer figures beyond lanes and MACs; the 16-bit ones only where the tune had a
    16-bit step."""
    columns = [("int8 ops", "ops_int8"), ("int4 ops", "ops_int4")]
    wide = any(r.get("gain16") is not None for r in lanes["layers"])
    if wide:
        columns.append(("int16 ops", "ops_int16"))
    columns.append(("sensitivity", "sensitivity"))
    if wide:
        columns.append(("16-bit gain", "gain16"))
    return columns


def _cell(row: dict, key: str) -> str:
    return f"{row[key]:,}" if key.startswith("ops_") else _value(row.get(key))


def lanes_text(record: dict) -> str:
    """The points (front marked; `reached`: mean - z sem >= target + margin, as the tuner decided) and each
    layer's lanes, MACs, DSP operations, sensitivity (and 16-bit gain), from the `lanes` part of a tune record
    (`<stem>.tune.json`)."""
    lanes = record["lanes"]
    front = {id(p) for p in pareto_front(lanes["points"])}
    chosen = lanes["chosen"]
    lines = [f"lane assignments measured ({len(lanes['points'])}; * on the Pareto front), validation cosine "
             f"(target {record['target_cosine']}):",
             f"  {'':1} {'assignment':<34} {'4-bit layers':>12} {'16-bit':>6} {'4-bit MACs':>10} {'MACs/DSP/cyc':>12} "
             f"{'cosine':>8} {'+- sem':>7} {'reached':>7}"]
    for p in sorted(lanes["points"], key=lambda p: p["throughput"]):
        lines.append(f"  {'*' if id(p) in front else ' '} {p['label'][:34]:<34} {len(p['four']):>12} "
                     f"{len(p.get('sixteen', [])):>6} {p['four_bit_macs']:>10.1%} {p['throughput']:>12.3f} "
                     f"{p['cosine']:>8.5f} {p['sem']:>7.5f} {'yes' if p['reached'] else 'no':>7}")
    wide = f", {len(chosen.get('sixteen', []))} on 16-bit lanes" if chosen.get("sixteen") else ""
    lines.append(f"  tuned: {chosen['label']} ({len(chosen['four'])} layers on 4-bit lanes{wide})")
    width = max(len(r["node"]) for r in lanes["layers"])
    columns = _layer_columns(lanes)
    lines += ["", f"layers ({len(lanes['layers'])}), in graph order:",
              f"  {'layer':<{width}} {'lanes':>5} {'MACs':>11} " + " ".join(f"{h:>11}" for h, _ in columns)]
    for r in lanes["layers"]:
        lines.append(f"  {r['node']:<{width}} {r['lanes']:>4}b {r['macs']:>11,} "
                     + " ".join(f"{_cell(r, key):>11}" for _, key in columns))
    return "\n".join(lines)


def lanes_html(record: dict, title: str = "") -> str:
    """The report.html section of a tune record's `lanes` (`ptq report --tune`): the Pareto figure, the
    assignments measured and each layer's lanes, MACs, DSP operations, sensitivity (and 16-bit gain)."""
    lanes = record["lanes"]
    front = {id(p) for p in pareto_front(lanes["points"])}
    chosen = lanes["chosen"]
    head = "".join(f"<th>{h}</th>" for h in ("front", "assignment", "4-bit layers", "16-bit layers", "4-bit MACs",
                                             "MACs/DSP/cycle", "cosine", "± sem", "reached"))
    rows = []
    for p in sorted(lanes["points"], key=lambda p: p["throughput"]):
        cls = ' class="suspect"' if p is chosen or p["label"] == chosen["label"] else ""
        cells = ["*" if id(p) in front else "", escape(p["label"]), str(len(p["four"])),
                 str(len(p.get("sixteen", []))), f"{p['four_bit_macs']:.1%}", f"{p['throughput']:.3f}",
                 f"{p['cosine']:.5f}", f"{p['sem']:.5f}", "yes" if p["reached"] else "no"]
        rows.append(f"<tr{cls}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    columns = _layer_columns(lanes)
    layer_head = "".join(f"<th>{h}</th>" for h in ["layer", "lanes", "MACs"] + [h for h, _ in columns])
    layer_rows = [f"<tr><td class=\"t\">{escape(r['node'])}</td><td>{r['lanes']}-bit</td><td>{r['macs']:,}</td>"
                  + "".join(f"<td>{_cell(r, key)}</td>" for _, key in columns) + "</tr>" for r in lanes["layers"]]
    wide = f" and {len(chosen.get('sixteen', []))} on 16-bit lanes" if chosen.get("sixteen") else ""
    return (f"<p>{len(chosen['four'])} of {len(lanes['layers'])} layers on 4-bit lanes{wide}, "
            f"{chosen['four_bit_macs']:.1%} of the MACs, {chosen['throughput']:.3f} MACs per DSP per cycle; validation "
            f"cosine {chosen['cosine']:.5f} (target {record['target_cosine']}). Every assignment the tuner measured; "
            f"* marks the Pareto front.</p>"
            + pareto_svg(lanes["points"], chosen, record["target_cosine"], title)
            + f'<table id="lane-points"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            + f'<p>Layers, in graph order (sensitivity: the cosine lost with the layer alone on 4-bit lanes, on '
              f'the fit samples, cross-fitted; 16-bit gain: the cosine gained with it alone on 16-bit lanes, on the '
              f'fit samples, where 8 bits missed the target).</p><table id="lane-layers"><thead><tr>{layer_head}'
              f'</tr></thead><tbody>{"".join(layer_rows)}</tbody></table>')


def lanes_record(path) -> dict:
    """The tune record at `path` (`<stem>.tune.json`), which must hold the `lanes` of `ptq tune --scheme
    int4-dsp`."""
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(record, dict) or not record.get("lanes"):
        raise ValueError(f"{path} is not the record of `ptq tune --scheme int4-dsp` (it has no lanes)")
    return record
