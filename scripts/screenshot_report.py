#!/usr/bin/env python3
"""Render a ptq report.html in headless Chromium and save a PNG screenshot (a check that it really renders).

    python3 scripts/screenshot_report.py report/report.html report/report.png [--width 1280 --height 2000]

Needs a Chromium binary (Debian: `apt-get install -y chromium`); it is found on PATH as chromium,
chromium-browser or google-chrome, or given with --chromium. The page is loaded from a file:// URL with the
network disabled, so a page that needed the network would render incompletely.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(explicit: str = None) -> str:
    if explicit:
        return explicit
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(f"no Chromium found on PATH (tried {', '.join(CANDIDATES)}); install it or pass --chromium")


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 2000, chromium: str = None) -> Path:
    html, png = Path(html).resolve(), Path(png).resolve()
    if not html.is_file():
        raise FileNotFoundError(f"report not found: {html}")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ptq-chromium-") as profile:
        cmd = [
            find_chromium(chromium), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
            f"--window-size={width},{height}", f"--screenshot={png}", html.as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2000)
    parser.add_argument("--chromium", help="path to the Chromium binary")
    args = parser.parse_args(argv)
    try:
        out = screenshot(args.html, args.png, args.width, args.height, args.chromium)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"screenshot_report: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
