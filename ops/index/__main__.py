"""`python -m ops.index [--write]`: says whether `ops/index/__init__.py` lists every registered op under the module
that registers it, or rewrites it (`OP_MODULES`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ops.registry import REGISTRY

INDEX = Path(__file__).with_name("__init__.py")


def registered_modules() -> dict[tuple[str, str], str]:
    """(domain, op_type) -> the module that registers it: iterating the registry imports every module of the
    package, whatever this file says."""
    return {key: type(op).__module__ for key, op in REGISTRY.items()}


def render(modules: dict[tuple[str, str], str]) -> str:
    """The index file with `OP_MODULES` listing `modules`, sorted by module, then domain, then op type."""
    text = INDEX.read_text()
    start = text.index("OP_MODULES = {")
    end = text.index("\n}\n", start) + 3
    rows = sorted(modules.items(), key=lambda item: (item[1], item[0]))
    listing = "OP_MODULES = {\n" + "".join(f'    ("{d}", "{t}"): "{m}",\n' for (d, t), m in rows) + "}\n"
    return text[:start] + listing + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.index", description=__doc__)
    parser.add_argument("--write", action="store_true",
                        help="rewrite ops/index/__init__.py (default: say whether it is stale)")
    args = parser.parse_args(argv)
    text = render(registered_modules())
    if text == INDEX.read_text():
        print("ops/index is up to date")
        return 0
    if args.write:
        INDEX.write_text(text)
        print("wrote ops/index/__init__.py")
        return 0
    print("ops/index is stale: run python -m ops.index --write")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
