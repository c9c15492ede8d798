"""The inline SVG of one layer's value histogram (`reports.value_histogram`) for report.html.

Bars on a log scale (1 + count), one per bin, drawn left to right: underflow, the margin below the grid, the
grid, the margin above it, overflow. The clipped tails (everything outside [low, high], which saturates) are
shaded red; the calibrated range is marked by two lines at the grid's ends with its [real_min, real_max]; the
quantization step is drawn as ticks along the grid (every step when they are at least 3 pixels apart, else every
2^k steps) and written out in the caption.
"""
from __future__ import annotations

import math
from html import escape

from ptq.core.qparams import QParams
from reports.value_histogram import ValueHistogram

HIST_W, HIST_H = 560, 230
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 26, 50
MIN_TICK_PX = 3.0
INNER, TAIL, OUTER = "#1c5fd1", "#d11c1c", "#7a1010"


def _g(value: float) -> str:
    return f"{value:.4g}"


def step_ticks(codes: int, px_per_step: float) -> int:
    """Steps between two ticks: 1, or the smallest power of two that puts ticks MIN_TICK_PX apart."""
    every = 1
    while every * px_per_step < MIN_TICK_PX and every < codes:
        every *= 2
    return every


def _px_per_step(qp: QParams, hist: ValueHistogram) -> float:
    """Pixels per quantization step of a per-tensor grid in the plot."""
    return (HIST_W - LEFT - RIGHT) / hist.counts.size * hist.inner / (qp.qmax - qp.qmin + 1)


def histogram_svg(hist: ValueHistogram, qp: QParams, label: str) -> str:
    """One histogram as an <svg> element (`label` names the tensor, for its aria-label)."""
    slots = hist.counts.size
    plot_w, plot_h = HIST_W - LEFT - RIGHT, HIST_H - TOP - BOTTOM
    bw = plot_w / slots
    first, past = 1 + hist.margin, 1 + hist.margin + hist.inner  # the grid's slots: [first, past)
    top = math.log10(1 + max(int(hist.counts.max()), 1))

    def sx(slot: float) -> float:
        return LEFT + slot * bw

    def sy(count: float) -> float:
        return TOP + plot_h * (1 - math.log10(1 + count) / top)

    x_low, x_high, base = sx(first), sx(past), TOP + plot_h
    parts = [f'<svg class="histogram" width="{HIST_W}" height="{HIST_H}" viewBox="0 0 {HIST_W} {HIST_H}" '
             f'role="img" aria-label="value histogram of {escape(label)}">',
             f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#999"/>',
             f'<rect class="tail" x="{LEFT}" y="{TOP}" width="{x_low - LEFT:.1f}" height="{plot_h}" '
             f'fill="{TAIL}" fill-opacity="0.12"/>',
             f'<rect class="tail" x="{x_high:.1f}" y="{TOP}" width="{LEFT + plot_w - x_high:.1f}" height="{plot_h}" '
             f'fill="{TAIL}" fill-opacity="0.12"/>']
    decade = 1
    while decade <= hist.counts.max():  # log-scale count axis
        y = sy(decade)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#e6e6e6"/>'
                     f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{decade:g}</text>')
        decade *= 10
    edges = hist.edges()
    for k, count in enumerate(hist.counts):
        if not count:
            continue
        if k == 0:
            span = f"below {_g(edges[0])}"
        elif k == slots - 1:
            span = f"at or above {_g(edges[-1])}"
        else:
            span = f"[{_g(edges[k - 1])}, {_g(edges[k])})"
        color = OUTER if k in (0, slots - 1) else (INNER if first <= k < past else TAIL)
        y = sy(count)
        parts.append(f'<rect class="bar" x="{sx(k) + 0.5:.1f}" y="{y:.1f}" width="{max(bw - 1, 1):.1f}" '
                     f'height="{base - y:.1f}" fill="{color}"><title>{span}: {count} values</title></rect>')
    lo, hi = qp.real_range()
    real_min, real_max = float(lo.min()), float(hi.max())  # per channel: the union of the channels' ranges
    for x, value, anchor in ((x_low, real_min, "end"), (x_high, real_max, "start")):
        parts.append(f'<line class="range" x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{base + 4}" '
                     f'stroke="#222" stroke-width="1.5" stroke-dasharray="4 2"/>')
        shift = -3 if anchor == "end" else 3
        parts.append(f'<text x="{x + shift:.1f}" y="{TOP - 8}" text-anchor="{anchor}">{_g(value)}</text>')
    parts.append(f'<text x="{(x_low + x_high) / 2:.1f}" y="{TOP - 8}" text-anchor="middle">calibrated range</text>')
    codes = qp.qmax - qp.qmin + 1
    if not qp.per_channel:
        px_per_step = _px_per_step(qp, hist)
        every = step_ticks(codes, px_per_step)
        path = "".join(f"M{x_low + j * px_per_step:.2f} {base:.1f}v4" for j in range(0, codes + 1, every))
        parts.append(f'<path class="steps" d="{path}" stroke="#222" stroke-width="0.6" fill="none"/>')
    labels = [(sx(1), edges[0]), (sx(slots - 1), edges[-1])]  # the grid's ends are labelled above the plot
    x_zero = sx(1) + (0 - edges[0]) / hist.width * bw
    if sx(1) < x_zero < sx(slots - 1) and all(abs(x_zero - x) > 40 for x in (sx(1), x_low, x_high, sx(slots - 1))):
        labels.append((x_zero, 0.0))  # 0, unless another label is near
    for x, value in labels:
        parts.append(f'<text x="{x:.1f}" y="{base + 16}" text-anchor="middle">{_g(value)}</text>')
    for x, count, anchor in ((LEFT + 3, hist.below, "start"), (LEFT + plot_w - 3, hist.above, "end")):
        if count:
            parts.append(f'<text x="{x:.1f}" y="{TOP + 14}" text-anchor="{anchor}" style="fill:{TAIL}">'
                         f'{count} clipped</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HIST_H - 8}" text-anchor="middle">float value '
                 f'(bars on a log scale; ticks under the grid: {_step_text(qp, hist)})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _step_text(qp: QParams, hist: ValueHistogram) -> str:
    if qp.per_channel:
        return f"per-channel steps {_g(float(qp.scale.min()))}..{_g(float(qp.scale.max()))}, not drawn"
    every = step_ticks(qp.qmax - qp.qmin + 1, _px_per_step(qp, hist))
    ticks = "every step" if every == 1 else f"every {every} steps"
    return f"{ticks} of {_g(float(qp.scale[0]))}"


def histogram_caption(hist: ValueHistogram, qp: QParams, images: int) -> str:
    """What the histogram holds, in words: values, extremes, clipped tails, the step and bin width."""
    total = hist.total
    if not total:
        return "no values"

    def share(n: int) -> str:
        return f"{n} ({100 * n / total:.3g}%)"

    grid = ("per-channel grid: bins over the union of the channels' ranges" if qp.per_channel else
            f"step {_g(float(qp.scale[0]))}, a bar = {hist.steps_per_bin:g} steps")
    return (f"{total} values over {images} images, from {_g(hist.min)} to {_g(hist.max)}; "
            f"clipped below {_g(hist.low)}: {share(hist.below)}, above {_g(hist.high)}: {share(hist.above)}; "
            f"{grid}")
