"""report.html in a real browser: headless Chromium loads the page, runs its script, lays it out and logs
nothing; the DOM holds every layer row, the plot with one hover target per layer and a histogram per top
suspect; hovering the plot names the layer. Skipped without a browser, except in CI (env CI set), where the
browser is part of the setup (`.ci/run` installs Debian's chromium) and its absence is a failure."""
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from headless_chromium import Page, find_browser
from reports.html import HISTOGRAM_SUSPECTS, render_html
from reports.layers import rank_bottlenecks
from tiny_models import conv_relu_gemm


@pytest.fixture(scope="module")
def page():
    """One headless Chromium for the module's tests (each loads its own page)."""
    path = find_browser()
    if path is None:
        message = "no Chromium on PATH (apt-get install chromium, or set PTQ_CHROMIUM)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests: {message}")
        pytest.skip(message)
    with Page(path) as page:
        yield page


@pytest.fixture(scope="module")
def report():
    """A real report of the tiny conv model with two ranges shrunk: the input and the Conv output clip."""
    from ptq.core.graph import load_model
    from ptq.calibration.pipeline import calibrate
    from reports.build import build_report
    from reports.evaluate import evaluate
    from ptq.data.image_source import ArraySamples
    from reports.tables import scale_range

    model = conv_relu_gemm(batch=1)
    x = np.random.default_rng(0).normal(size=(6, 3, 8, 8)).astype(np.float32)
    table = calibrate(model, x, write_qdq=False).table
    damaged = scale_range(scale_range(table, "input", 1 / 2), "act", 1 / 3)
    report = build_report(evaluate(load_model(model), damaged, ArraySamples(x)), "tiny <model>.onnx", "damaged")
    assert len(report.bottlenecks) >= 2 and report.layers[0].histogram.below > 0
    return report


def _load(page: Page, html: str, folder: Path) -> None:
    path = folder / "report.html"
    path.write_text(html, encoding="utf-8")
    page.load(path.as_uri())


DOM = """(() => {
  const texts = sel => Array.from(document.querySelectorAll(sel), e => e.textContent);
  const attrs = (sel, a) => Array.from(document.querySelectorAll(sel), e => e.getAttribute(a));
  const plot = document.querySelector('.plot svg').getBoundingClientRect();
  return {
    rows: texts('#layers tbody tr td:nth-child(2)'),
    polylines: document.querySelectorAll('.plot svg polyline').length,
    points: attrs('.plot g.pt', 'data-layer'),
    titles: texts('.plot g.pt title'),
    plot: [plot.width, plot.height],
    figures: attrs('figure.hist', 'data-layer'),
    hists: Array.from(document.querySelectorAll('figure.hist'), f => ({
      bars: Array.from(f.querySelectorAll('rect.bar'), r => r.getBBox().height),
      ranges: f.querySelectorAll('line.range').length,
      steps: f.querySelectorAll('path.steps').length,
      clipped: texts.call(null, 'figure.hist[data-layer="' + f.dataset.layer + '"] svg text')
        .filter(t => t.endsWith('clipped')),
      caption: f.querySelector('figcaption').textContent,
    })),
  };
})()"""


def test_page_renders_every_row_the_plot_and_the_histograms_without_console_errors(page, report, tmp_path):
    _load(page, render_html(report), tmp_path)
    dom = page.evaluate(DOM)
    errors = page.errors()
    shot = page.screenshot(tmp_path / "report.png")
    assert errors == []
    names = [layer.name for layer in report.layers]
    assert dom["rows"] == names
    assert dom["polylines"] == 2 and dom["points"] == names
    assert all(title.split(" ")[1] == name for title, name in zip(dom["titles"], names))
    assert dom["plot"][0] > 500 and dom["plot"][1] > 200  # laid out at its size
    suspects = [b.name for b in report.bottlenecks[:HISTOGRAM_SUSPECTS]]
    assert dom["figures"] == suspects
    layers = {layer.name: layer for layer in report.layers}
    for name, hist in zip(suspects, dom["hists"]):
        counts = layers[name].histogram.counts
        assert len(hist["bars"]) == np.count_nonzero(counts) and min(hist["bars"]) > 0  # every bar drawn
        assert hist["ranges"] == 2 and hist["steps"] == 1
        expected = [f"{n} clipped" for n in (layers[name].histogram.below, layers[name].histogram.above) if n]
        assert hist["clipped"] == expected
        assert f"{counts.sum()} values over {report.images} images" in hist["caption"]
    assert dom["hists"][0]["clipped"]  # the damaged input's tails are shown
    image = Image.open(shot).convert("RGB")
    assert image.width >= 1000 and image.height > 1000
    pixels = np.asarray(image).reshape(-1, 3).astype(int)
    bar_blue = np.all(np.abs(pixels - (0x1C, 0x5F, 0xD1)) <= 8, axis=1)
    tail_red = np.all(np.abs(pixels - (0xD1, 0x1C, 0x1C)) <= 8, axis=1)
    assert bar_blue.sum() > 2000 and tail_red.sum() > 50  # the curves and bars, and the clipped bars


def test_hovering_the_plot_names_the_layer(page, report, tmp_path):
    _load(page, render_html(report), tmp_path)
    assert page.evaluate("document.getElementById('plot-tip').hidden") is True
    for k in (0, 2, len(report.layers) - 1):
        box = page.evaluate(f"(() => {{ const r = document.querySelectorAll('.plot g.pt rect')[{k}]"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        page.hover(*box)
        tip = page.evaluate("(() => { const t = document.getElementById('plot-tip');"
                            " return [t.hidden, t.textContent, t.getBoundingClientRect().width]; })()")
        assert tip[0] is False and tip[2] > 0
        assert tip[1].startswith(f"{k} {report.layers[k].name} ({report.layers[k].op_type}): cumulative ")
    # on a suspect's red circle (drawn over the hover targets): its layer, with its rank
    first = [layer.name for layer in report.layers].index(report.bottlenecks[0].name)
    centre = page.evaluate("(() => { const c = document.querySelector('.plot circle.mark').getBoundingClientRect();"
                           " return [c.x + c.width / 2, c.y + c.height / 2]; })()")
    page.hover(5, 5)
    page.hover(centre[0] + 5, centre[1])  # on the circle's stroke (r = 5)
    tip = page.evaluate("document.getElementById('plot-tip').textContent")
    assert tip.startswith(f"{first} {report.bottlenecks[0].name} (") and "suspect #1: " in tip
    page.hover(5, 5)  # off the plot
    assert page.evaluate("document.getElementById('plot-tip').hidden") is True
    assert page.errors() == []


def test_an_error_in_the_page_script_is_detected(page, report, tmp_path):
    """The detection the other tests rely on: the page's own script broken (reads a property of null)."""
    html = render_html(report)
    statement = "var tip = document.getElementById('plot-tip');"
    assert statement in html
    _load(page, html.replace(statement, statement + " null.broken;"), tmp_path)
    errors = page.errors()
    assert [(e.source, e.text.split(":")[0]) for e in errors] == [("exception", "TypeError")]


def test_console_error_is_detected(page, report, tmp_path):
    html = render_html(report).replace("</body>", "<script>console.error('deliberate', 'error');</script></body>")
    _load(page, html, tmp_path)
    assert [(e.source, e.text) for e in page.errors()] == [("console", "deliberate error")]


def test_the_layer_table_fits_a_1280_pixel_window_with_exporters_long_names(page, report, tmp_path):
    """Issue 27, item 3: at 1280 px the table's "clipped %" and "suspect" columns were cut off (long tensor names
    of exporters, `/features/features.3/conv/conv.0/Conv_output_0`, kept on one line)."""
    import dataclasses

    rename = {layer.name: f"/features/features.{k}/conv/conv.0/Conv_output_0/{layer.name}_with_a_long_suffix"
              for k, layer in enumerate(report.layers)}
    layers = [dataclasses.replace(layer, name=rename[layer.name], inputs=[rename[i] for i in layer.inputs],
                                  op_type="GlobalAveragePool") for layer in report.layers]
    wide = dataclasses.replace(report, layers=layers, bottlenecks=rank_bottlenecks(layers))
    _load(page, render_html(wide), tmp_path)
    right, window, page_width, last = page.evaluate(
        "(() => { const t = document.getElementById('layers'); const head = t.querySelectorAll('th');"
        " return [t.getBoundingClientRect().right, window.innerWidth, document.documentElement.scrollWidth,"
        " head[head.length - 1].getBoundingClientRect().right]; })()")
    assert window == 1280 and right <= window and last <= window and page_width <= window
    assert page.errors() == []
