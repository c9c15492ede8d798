"""report.html: one self-contained page (inline CSS, inline SVG plot, inline script; no network).

The plot shows the cumulative and isolated cosine of every layer along the graph (x = topological index),
with the ranked suspects marked; hovering a layer's column names it (a tooltip, and the SVG <title>). The
top suspects get a histogram of their float values (`reports.html_histogram`); the table sorts by any column
on a click of its header.
"""
from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Optional, Union

from ptq.core.atomic import atomic_write_text
from reports.diagnosis import next_step_lines
from reports.html_histogram import histogram_caption, histogram_svg
from reports.detections import detection_line
from reports.lane_pareto import lanes_html
from reports.layers import Report
from reports.writers import suspect_line
from reports.output_breakdown import DEAD_CODES

PLOT_W, PLOT_H = 960, 320
HISTOGRAM_SUSPECTS = 5  # the top suspects that get a value histogram
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 64, 16, 16, 40

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222}
h1{font-size:22px;margin:0 0 8px} h2{font-size:17px;margin:24px 0 8px}
table{border-collapse:collapse;font-size:12px}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:right;white-space:nowrap}
td.t,th.t{text-align:left}
th{background:#f0f0f0;cursor:pointer;user-select:none}
th.asc::after{content:" \\25B2"} th.desc::after{content:" \\25BC"}
tr.suspect td{background:#fde8e8}
#layers th{white-space:normal;padding:3px 4px} #layers td{padding:3px 4px}
#layers td.name{white-space:normal;overflow-wrap:anywhere;min-width:10em;max-width:18em}
.summary td{text-align:left}
svg text{font-size:11px;fill:#333}
.legend span{display:inline-block;margin-right:16px;font-size:13px}
.sw{display:inline-block;width:14px;height:3px;vertical-align:middle;margin-right:4px}
.plot{position:relative;display:inline-block}
.tip{position:absolute;pointer-events:none;background:#fff;border:1px solid #888;padding:2px 6px;font-size:12px;
white-space:nowrap;box-shadow:1px 1px 3px rgba(0,0,0,.2)}
g.pt rect{fill:#000;fill-opacity:0;pointer-events:all} g.pt:hover rect{fill-opacity:.06} .mark{pointer-events:none}
.warn{background:#fde8e8;border:1px solid #d11c1c;padding:6px 12px;margin:8px 0} h3{font-size:15px}
.hists{display:flex;flex-wrap:wrap;gap:8px 24px} figure{margin:0} figcaption{font-size:12px;max-width:560px}
"""

_SCRIPT = """
document.querySelectorAll('table.sortable').forEach(function(table){
  var heads = table.querySelectorAll('th');
  heads.forEach(function(th, col){
    th.addEventListener('click', function(){
      var asc = !th.classList.contains('asc');
      heads.forEach(function(h){h.classList.remove('asc','desc');});
      th.classList.add(asc ? 'asc' : 'desc');
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function(a, b){
        var x = a.cells[col].getAttribute('data-v'), y = b.cells[col].getAttribute('data-v');
        var nx = parseFloat(x), ny = parseFloat(y), r;
        if (!isNaN(nx) && !isNaN(ny)) { r = nx - ny; } else { r = x < y ? -1 : (x > y ? 1 : 0); }
        return asc ? r : -r;
      });
      rows.forEach(function(row){ body.appendChild(row); });
    });
  });
});

var tip = document.getElementById('plot-tip');
if (tip) {
  document.querySelectorAll('g.pt').forEach(function(g){
    g.addEventListener('mouseenter', function(){
      tip.textContent = g.querySelector('title').textContent;
      var box = g.querySelector('rect').getBBox();
      var right = box.x > tip.parentNode.clientWidth / 2;
      tip.style.left = right ? '' : (box.x + box.width + 4) + 'px';
      tip.style.right = right ? (tip.parentNode.clientWidth - box.x + 4) + 'px' : '';
      tip.style.top = '4px';
      tip.hidden = false;
    });
    g.addEventListener('mouseleave', function(){ tip.hidden = true; });
  });
}
"""


def _fmt(value: float, digits: int = 6) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def _sort_key(value) -> str:
    """The data-v attribute: numbers sort numerically (infinities as large finite numbers)."""
    if isinstance(value, float) and math.isinf(value):
        return "1e308" if value > 0 else "-1e308"
    return str(value)


def _cell(value, text: Optional[str] = None, left: bool = False, cls: str = "") -> str:
    """A cell whose data-v attribute sorts it; `left`: text aligned left; `cls`: more classes."""
    classes = " ".join(c for c in ("t" if left else "", cls) if c)
    cls = f' class="{classes}"' if classes else ""
    shown = escape(text if text is not None else str(value))
    return f'<td{cls} data-v="{escape(_sort_key(value))}">{shown}</td>'


def _y_floor(lo: float) -> float:
    """The bottom of the cosine axis: half a step below the worst cosine, the step being the power of ten
    of 1 - worst (so 0.9991 plots from 0.99905, 0.87 from 0.75), never below -1 nor at 1."""
    if lo >= 1.0:
        return 1.0 - 1e-6
    step = 10 ** math.floor(math.log10(1.0 - lo))
    return max(-1.0, math.floor(lo / step) * step - 0.5 * step)


def _plot(report: Report) -> str:
    layers = report.layers
    n = len(layers)
    if n == 0:
        return "<p>No layers.</p>"
    cum = [layer.cumulative.cosine for layer in layers]
    iso = [layer.isolated.cosine for layer in layers]
    y_min = _y_floor(min(min(cum), min(iso)))
    w = PLOT_W - MARGIN_L - MARGIN_R
    h = PLOT_H - MARGIN_T - MARGIN_B

    def px(i: int) -> float:
        return MARGIN_L + (w * i / (n - 1) if n > 1 else w / 2)

    def py(v: float) -> float:
        return MARGIN_T + h * (1.0 - (v - y_min) / (1.0 - y_min))

    parts = [f'<svg width="{PLOT_W}" height="{PLOT_H}" '
             f'viewBox="0 0 {PLOT_W} {PLOT_H}" role="img" aria-label="cosine along the graph">',
             f'<rect x="{MARGIN_L}" y="{MARGIN_T}" width="{w}" height="{h}" fill="#fafafa" stroke="#999"/>']
    for k in range(6):
        v = y_min + (1.0 - y_min) * k / 5
        y = py(v)
        parts.append(f'<line x1="{MARGIN_L}" y1="{y:.1f}" x2="{MARGIN_L + w}" y2="{y:.1f}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{MARGIN_L - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.6g}</text>')
    for k in range(0, n, max(1, n // 10)):
        parts.append(f'<text x="{px(k):.1f}" y="{MARGIN_T + h + 16}" text-anchor="middle">{k}</text>')
    parts.append(f'<text x="{MARGIN_L + w / 2}" y="{PLOT_H - 6}" text-anchor="middle">layer (topological order)</text>')
    for values, color in ((iso, "#2b8a3e"), (cum, "#1c5fd1")):
        points = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(values))
        parts.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    column = w / (n - 1) if n > 1 else w
    ranked = {b.name: (rank, b.reason) for rank, b in enumerate(report.bottlenecks[:10], 1)}
    for i, layer in enumerate(layers):  # one hover target per layer: its column, and a dot per curve
        suspect = f"; suspect #{ranked[layer.name][0]}: {ranked[layer.name][1]}" if layer.name in ranked else ""
        parts.append(
            f'<g class="pt" data-layer="{escape(layer.name)}">'
            f'<title>{i} {escape(layer.name)} ({escape(layer.op_type)}): cumulative {cum[i]:.6f}, '
            f'isolated {iso[i]:.6f}{escape(suspect)}</title>'
            f'<rect x="{px(i) - column / 2:.1f}" y="{MARGIN_T}" width="{column:.1f}" height="{h}"/>'
            f'<circle cx="{px(i):.1f}" cy="{py(cum[i]):.1f}" r="2" fill="#1c5fd1"/>'
            f'<circle cx="{px(i):.1f}" cy="{py(iso[i]):.1f}" r="2" fill="#2b8a3e"/></g>')
    index = {layer.name: i for i, layer in enumerate(layers)}
    for rank, b in enumerate(report.bottlenecks[:10], 1):  # drawn over the hover targets, transparent to the mouse
        i = index.get(b.name)
        if i is None:
            continue
        x, y = px(i), py(min(cum[i], iso[i]))
        parts.append(f'<circle class="mark" cx="{x:.1f}" cy="{y:.1f}" r="5" fill="none" stroke="#d11c1c" '
                     'stroke-width="2"/>')
        parts.append(f'<text class="mark" x="{x + 7:.1f}" y="{y - 6:.1f}" fill="#d11c1c" style="fill:#d11c1c">'
                     f'{rank}</text>')
    parts.append("</svg>")
    legend = ('<div class="legend"><span><i class="sw" style="background:#1c5fd1"></i>cumulative cosine</span>'
              '<span><i class="sw" style="background:#2b8a3e"></i>isolated cosine</span>'
              '<span style="color:#d11c1c">&#9711; ranked suspects</span></div>')
    return legend + '<div class="plot">' + "".join(parts) + '<div id="plot-tip" class="tip" hidden=""></div></div>'


def _summary(report: Report) -> str:
    rows = [("model", report.model), ("quant table", report.quant), ("images", str(report.images)),
            ("quantized tensors", str(len(report.layers)))]
    for out in report.outputs:
        s = out.similarity
        rows.append((f"output {out.name}",
                     f"cosine {s.cosine:.6f}, mse {_fmt(s.mse, 4)}, sqnr {_fmt(s.sqnr_db, 4)} dB, "
                     f"max abs err {_fmt(s.max_abs_err, 4)}"))
    for name, agreement in report.index_outputs.items():
        rows.append((f"output {name}", f"agreement with float {agreement['agreement']:.4f} "
                                       f"({agreement['equal']}/{agreement['values']} values)"))
    c = report.classification
    if c:
        if "top5_agreement" in c:  # only with 10 classes or more
            rows.append(("top-1 / top-5 agreement", f"{c['top1_agreement']:.3f} / {c['top5_agreement']:.3f}"))
        else:
            rows.append(("top-1 agreement", f"{c['top1_agreement']:.3f}"))
        if "labelled" in c:
            rows.append(("accuracy (float / int)",
                         f"{c['float_accuracy']:.3f} / {c['int_accuracy']:.3f} over {c['labelled']} labelled images"))
        else:
            rows.append(("accuracy", "no labels (a labels file, or every image named NAME_LABEL): agreement "
                                     "with float only"))
    if report.float_nodes:
        rows.append((f"{len(report.float_nodes)} node(s) run in float",
                     "; ".join(f"{n} ({report.float_reasons[n]})" if n in report.float_reasons else n
                               for n in report.float_nodes)))
    else:
        rows.append(("float nodes", "none: every node ran in integers"))
    for note in report.notes:
        rows.append(("note", note))
    for line in next_step_lines(report):
        rows.append(("where the loss is", line))
    if report.detections:
        rows.append(("detections", detection_line(report.detections)))
    body = "".join(f'<tr><th class="t">{escape(k)}</th><td>{escape(v)}</td></tr>' for k, v in rows)
    suspects = "".join(f"<li><b>{escape(b.name)}</b>: {escape(suspect_line(report, b)[len(b.name) + 2:])}</li>"
                       for b in report.bottlenecks[:10])
    return (f'<table class="summary">{body}</table><h2>Top suspects</h2>'
            "<p>Isolated: the layer alone on quantized float inputs (the error it makes); cumulative: the integer "
            "graph end to end (the error that reaches it). A layer that adds almost nothing alone while the "
            "cumulative cosine falls across it amplifies error made upstream.</p>"
            + (f"<ol>{suspects}</ol>" if suspects else "<p>None: every layer keeps its cosine.</p>"))


def _warnings(report: Report) -> str:
    """The warnings (dead output parts or channels), first on the page."""
    if not report.warnings:
        return ""
    items = "".join(f"<li>{escape(w)}</li>" for w in report.warnings)
    return f'<div class="warn" id="warnings"><b>Warnings</b><ul>{items}</ul></div>'


def _output_groups(report: Report) -> str:
    """Per output, its parts (a join) and the spread of its channel cosines, with each dead group marked."""
    sections = []
    for out in report.outputs:
        b = out.breakdown
        if b.parts is None and b.channels is None:
            continue
        heads = ["group", "where", "elements", "cosine", "sqnr dB", "mse", "max err", "float min", "float max",
                 "codes", "dead"]
        rows = []
        for kind, groups in (("part", b.parts), ("channel", b.channels)):
            for g in groups or ():
                cls = ' class="suspect"' if g.dead else ""
                codes = str(g.codes) if g.codes <= DEAD_CODES else f">{DEAD_CODES}"
                rows.append(
                    f"<tr{cls}>" + "".join([
                        _cell(f"{kind} {g.name}", left=True), _cell(g.span, left=True), _cell(g.elements),
                        _cell(g.cosine, f"{g.cosine:.6f}"), _cell(g.sqnr_db, _fmt(g.sqnr_db, 4)),
                        _cell(g.mse, _fmt(g.mse, 4)), _cell(g.max_abs_err, _fmt(g.max_abs_err, 4)),
                        _cell(g.float_min, _fmt(g.float_min, 4)), _cell(g.float_max, _fmt(g.float_max, 4)),
                        _cell(g.codes, codes), _cell(int(g.dead), "dead" if g.dead else "")]) + "</tr>")
        spread = b.spread()
        caption = ""
        if spread is not None:
            caption = (f"<p>{len(b.channels)} channels on axis 1: cosine min {spread['min']:.6f} (channel "
                       f"{spread['worst_channel']}), median {spread['median']:.6f}, max {spread['max']:.6f}.</p>")
        head = "".join(f'<th class="t">{h}</th>' if h in ("group", "where") else f"<th>{h}</th>" for h in heads)
        sections.append(f"<h3>{escape(out.name)}</h3>{caption}<table class=\"sortable\"><thead><tr>{head}</tr>"
                        f"</thead><tbody>{''.join(rows)}</tbody></table>")
    if not sections:
        return ""
    return ("<h2>Output parts and channels</h2><p>Each part of an output that joins tensors, and each channel of an "
            "output with up to 256: cosine over all its values of all images, the distinct integer codes it takes "
            f"(dead: {DEAD_CODES} or fewer while its float values, on a grid of their own, take more).</p>" + "".join(sections))


def _histograms(report: Report, count: int) -> str:
    """A value histogram for each of the first `count` suspects."""
    layers = {layer.name: layer for layer in report.layers}
    figures = []
    for rank, b in enumerate(report.bottlenecks[:count], 1):
        layer = layers.get(b.name)
        if layer is None or layer.histogram is None:
            continue
        figures.append(
            f'<figure class="hist" data-layer="{escape(layer.name)}">'
            f"{histogram_svg(layer.histogram, layer.qparams, layer.name)}"
            f"<figcaption><b>#{rank} {escape(layer.name)}</b> ({escape(layer.op_type)}): "
            f"{escape(histogram_caption(layer.histogram, layer.qparams, report.images))}</figcaption></figure>")
    if not figures:
        return "<p>No suspects, no histograms.</p>"
    return ('<p>Each suspect\'s float values in fixed bins: blue inside the calibrated range, red in the clipped '
            "tails (shaded: they saturate when quantized), the outermost dark bars count everything further out. "
            "Hover a bar for its range and count.</p>"
            f'<div class="hists">{"".join(figures)}</div>')


def _table(report: Report) -> str:
    ranks = {b.name: k for k, b in enumerate(report.bottlenecks, 1)}
    heads = ["#", "tensor", "op", "bits", "scale", "zp", "cum cosine", "cum sqnr dB", "cum mse", "cum max err",
             "iso cosine", "iso sqnr dB", "iso mse", "cosine drop", "clipped %", "suspect"]
    head = "".join(f'<th class="t">{h}</th>' if h in ("tensor", "op") else f"<th>{h}</th>" for h in heads)
    rows = []
    for i, layer in enumerate(report.layers):
        qp = layer.qparams
        if qp.per_channel:
            scale_v, scale_t = float(qp.scale.max()), f"{qp.scale.min():.3g}..{qp.scale.max():.3g}"
            zp_v, zp_t = int(qp.zero_point.max()), f"{qp.zero_point.min()}..{qp.zero_point.max()}"
        else:
            scale_v, scale_t = float(qp.scale[0]), f"{qp.scale[0]:.4g}"
            zp_v, zp_t = int(qp.zero_point[0]), str(int(qp.zero_point[0]))
        cum, iso = layer.cumulative, layer.isolated
        rank = ranks.get(layer.name)
        cls = ' class="suspect"' if rank is not None and rank <= 10 else ""
        op = layer.op_type + (" (float)" if layer.float_fallback else "")
        cells = [
            _cell(i), _cell(layer.name, left=True, cls="name"), _cell(op, left=True), _cell(qp.bits), _cell(scale_v, scale_t),
            _cell(zp_v, zp_t), _cell(cum.cosine, f"{cum.cosine:.6f}"), _cell(cum.sqnr_db, _fmt(cum.sqnr_db, 4)),
            _cell(cum.mse, _fmt(cum.mse, 4)), _cell(cum.max_abs_err, _fmt(cum.max_abs_err, 4)),
            _cell(iso.cosine, f"{iso.cosine:.6f}"), _cell(iso.sqnr_db, _fmt(iso.sqnr_db, 4)),
            _cell(iso.mse, _fmt(iso.mse, 4)), _cell(layer.cosine_drop, f"{layer.cosine_drop:.6f}"),
            _cell(layer.clipped, f"{100 * layer.clipped:.3g}"),
            _cell(rank if rank is not None else 1e9, str(rank) if rank is not None else ""),
        ]
        rows.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f'<table class="sortable" id="layers"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def render_html(report: Report, histograms: int = HISTOGRAM_SUSPECTS, lanes: Optional[dict] = None) -> str:
    """The page; `histograms`: how many of the top suspects get a value histogram; `lanes`: the record of
    `ptq tune --scheme int4-dsp` whose trade-off (`reports.lane_pareto.lanes_html`) the page shows."""
    title = f"ptq report: {Path(report.model).name}"
    lane_section = (f"<h2>DSP lanes: accuracy against throughput</h2>"
                    f"{lanes_html(lanes, f'{Path(report.model).name}: validation cosine against DSP throughput')}"
                    if lanes is not None else "")
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"/><title>{escape(title)}</title>'
        f"<style>{_CSS}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f"{_warnings(report)}"
        f"<h2>Summary</h2>{_summary(report)}"
        f"{_output_groups(report)}"
        f"{lane_section}"
        f"<h2>Cosine along the graph</h2>{_plot(report)}"
        f"<h2>Values of the top suspects</h2>{_histograms(report, histograms)}"
        f"<h2>Layers</h2><p>Click a column header to sort.</p>{_table(report)}"
        f"<script>//<![CDATA[{_SCRIPT}//]]></script>"
        "</body></html>\n"
    )


def write_html(report: Report, path: Union[str, Path], histograms: int = HISTOGRAM_SUSPECTS,
               lanes: Optional[dict] = None) -> Path:
    return atomic_write_text(path, render_html(report, histograms, lanes))
