"""`ops.index.OP_MODULES` against the ops the modules of `ops/` really register, and the lazy registry: a look-up
imports the op's own module, iteration every module."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ops.index import OP_MODULES
from ops.index.__main__ import INDEX, registered_modules, render
from ops.registry import REGISTRY, absorbable_ops, is_absorbable

ROOT = Path(__file__).resolve().parents[1]


def test_index_names_the_module_of_every_registered_op():
    registered = {key: type(op).__module__ for key, op in REGISTRY.items()}  # iterating imports every module
    missing = sorted(set(registered) - set(OP_MODULES))
    assert not missing, "run python -m ops.index --write; missing: " + " ".join(f"{d}::{t}" for d, t in missing)
    assert OP_MODULES == registered


def test_the_index_file_is_what_the_generator_writes():
    """`python -m ops.index --write` leaves the file as it is; an op added or moved makes it stale."""
    modules = registered_modules()
    assert render(modules) == INDEX.read_text(), "run python -m ops.index --write"
    moved = {**modules, ("", "Relu"): "ops.unary_exact"}
    assert render(moved) != INDEX.read_text()
    assert '("", "Relu"): "ops.unary_exact",' in render(moved)


def test_the_command_says_when_the_index_is_stale():
    done = subprocess.run([sys.executable, "-m", "ops.index"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "ops/index is up to date", "")


def test_is_absorbable_agrees_with_the_full_list():
    types = sorted({t for _, t in OP_MODULES} | {"NoSuchOp"})
    assert [t for t in types if is_absorbable(t)] == absorbable_ops()


LOOKUP = """
import json, sys
from ops.registry import REGISTRY, get_op
conv = get_op("Conv")
after_lookup = sorted(m for m in sys.modules if m.startswith("ops.") and not m.startswith("ops.compiled"))
unknown = get_op("NoSuchOp"), ("", "NoSuchOp") in REGISTRY
count = len(REGISTRY)
print(json.dumps({"conv": type(conv).__module__, "after_lookup": after_lookup, "unknown": unknown, "count": count,
                  "modules": len([m for m in sys.modules if m.startswith("ops.") and m.count(".") == 1])}))
"""


def test_a_lookup_imports_the_ops_module_only():
    """In a fresh interpreter: get_op('Conv') imports ops.conv (and what it imports), not the other op modules;
    an unknown op is None; len() imports them all."""
    done = subprocess.run([sys.executable, "-c", LOOKUP], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=True)
    seen = json.loads(done.stdout)
    assert seen["conv"] == "ops.conv"
    assert "ops.conv" in seen["after_lookup"] and "ops.pooling" not in seen["after_lookup"]
    assert "ops.resize" not in seen["after_lookup"] and len(seen["after_lookup"]) < 10
    assert seen["unknown"] == [None, False]
    assert seen["count"] == len(OP_MODULES)
    assert seen["modules"] >= len(set(OP_MODULES.values()))
