"""The layering of the project (docs/architecture.md): `ptq.core` is the ground floor and imports nothing else
of the project; `lut`, `calibrators`, `ops` and `dsp` stand on it (ops also on lut); `reports` and the rest of `ptq`
stand on all of them. This test walks every import statement of the lower layers and fails on any other arrow.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("ptq", "ops", "lut", "calibrators", "reports", "dsp")

# package (as a path prefix) -> the project modules it may import (a module matches itself and its submodules)
ALLOWED = {
    "ptq/core": ("ptq.core",),
    "lut": ("lut", "ptq.core"),
    "calibrators": ("calibrators", "ptq.core"),
    "ops": ("ops", "lut", "ptq.core"),
    "dsp": ("dsp", "ptq.core"),
}


def _imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, imported names) of every import in a file; relative imports keep their dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((node.lineno, module, tuple(alias.name for alias in node.names)))
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_violations(root: Path, layer: str, allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((root / layer).rglob("*.py")):
        where = path.relative_to(root)
        for line, module, names in _imports(path):
            if module.startswith("."):
                bad.append(f"{where}:{line}: relative import {module!r}")
            elif module.split(".")[0] in PROJECT and not _within(module, allowed):
                # `from ptq import core` imports ptq.core: judge the submodules it names
                if not names or not all(_within(f"{module}.{n}", allowed) for n in names):
                    bad.append(f"{where}:{line}: imports {module}")
    return bad


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_lower_layers_import_only_what_stands_below(layer):
    assert layer_violations(ROOT, layer, ALLOWED[layer]) == []


def test_the_check_catches_an_upward_import(tmp_path):
    """The walker itself: upward arrows planted in a fake tree are reported, allowed ones are not."""
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "bad.py").write_text("import numpy as np\nfrom ptq.executor import prepare\n"
                                             "from ptq.core.qparams import QParams\nfrom ptq import core\n"
                                             "import reports.html\n")
    (tmp_path / "ptq" / "core").mkdir(parents=True)
    (tmp_path / "ptq" / "core" / "bad.py").write_text("from ops.registry import get_op\nfrom . import graph\n")
    assert layer_violations(tmp_path, "ops", ALLOWED["ops"]) == [
        "ops/bad.py:2: imports ptq.executor", "ops/bad.py:5: imports reports.html"]
    assert layer_violations(tmp_path, "ptq/core", ALLOWED["ptq/core"]) == [
        "ptq/core/bad.py:1: imports ops.registry", "ptq/core/bad.py:2: relative import '.'"]
