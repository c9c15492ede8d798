"""The layering of the project (docs/architecture.md): floors, each importing only itself and the floors below.
`ptq.core` is the ground floor; `lut`, `calibrators`, `ops` and `dsp` stand on it; then, inside `ptq`, the quant
table, the engine (prepare and run the integer graph, the float runs), the data (samples, images, labels), the
workers, the QDQ export, `reports`, the adjustments, calibration, the tuner, the op docs, and at the top the API
and the command line (`ptq/api.py`, `ptq/cli.py`, `ptq/data_options.py`, `ptq/commands`). A linear order of
floors has no circle. This test walks every import statement of every package and fails on any other arrow.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("ptq", "ops", "lut", "calibrators", "reports", "dsp")

GROUND = ("ptq.core",)
KERNELS = GROUND + ("lut", "calibrators", "ops", "dsp")
# `ptq/__init__.py` imports nothing at module level: its constants may be read from any floor above the kernels
ROOT_CONSTANTS = ("ptq.__version__", "ptq.IMPORTED_AT")
FLOORS = ("ptq.table", "ptq.engine", "ptq.data", "ptq.parallel", "ptq.qdq", "reports", "ptq.adjust",
          "ptq.calibration", "ptq.tuning", "ptq.opdocs")
TOP = ("ptq/commands",)

# package (as a path prefix) -> the project modules it may import (a module matches itself and its submodules)
ALLOWED = {
    "ptq/core": GROUND,
    "lut": ("lut",) + GROUND,
    "calibrators": ("calibrators",) + GROUND,
    "ops": ("ops", "lut") + GROUND,
    "dsp": ("dsp",) + GROUND,
    **{floor.replace(".", "/"): KERNELS + ROOT_CONSTANTS + FLOORS[:i + 1] for i, floor in enumerate(FLOORS)},
    **{top: PROJECT for top in TOP},
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
    (tmp_path / "ops" / "bad.py").write_text("import numpy as np\nfrom ptq.engine.executor import prepare\n"
                                             "from ptq.core.qparams import QParams\nfrom ptq import core\n"
                                             "import reports.html\n")
    (tmp_path / "ptq" / "core").mkdir(parents=True)
    (tmp_path / "ptq" / "core" / "bad.py").write_text("from ops.registry import get_op\nfrom . import graph\n")
    assert layer_violations(tmp_path, "ops", ALLOWED["ops"]) == [
        "ops/bad.py:2: imports ptq.engine.executor", "ops/bad.py:5: imports reports.html"]
    assert layer_violations(tmp_path, "ptq/core", ALLOWED["ptq/core"]) == [
        "ptq/core/bad.py:1: imports ops.registry", "ptq/core/bad.py:2: relative import '.'"]


def test_every_package_has_a_rule():
    """A new subpackage (or top-level package) gets its floor here before it lands."""
    packages = {str(init.parent.relative_to(ROOT)) for name in PROJECT for init in (ROOT / name).rglob("__init__.py")}
    ruled = {package for package in packages if any(package == rule or package.startswith(rule + "/")
                                                   for rule in ALLOWED)}
    assert packages - ruled == {"ptq"}  # the root package: the API and the command line, above every floor
