"""What the command line imports before a command runs: `import ptq`, `ptq --help` and every `ptq CMD --help`
build the parser from small modules (`ptq.core.option_defaults`, `ptq.qdq.targets`, `ptq.engine.backends`), never the
machinery a command runs (numpy, onnx, onnxruntime, numba, the op registry). Each check runs in a fresh
interpreter, since this test process has imported everything already."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ptq.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "scipy", "onnx", "onnxruntime", "numba", "PIL", "ops", "calibrators", "reports", "lut", "dsp")

# Per argv, the heavy top-level packages in sys.modules after it; `calibrate --help` runs last, since its
# epilog (printed with the help only) lists the calibrators, which import numpy.
PROBE = """
import contextlib, io, json, sys
heavy = set(json.loads(sys.argv[1]))
loaded = lambda: sorted({m.split(".")[0] for m in sys.modules} & heavy)
seen = {"import ptq": (__import__("ptq"), loaded())[1]}
from ptq.cli import main
for argv in json.loads(sys.argv[2]):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            main(argv)
        except SystemExit:
            pass
    seen[" ".join(argv)] = loaded() if "usage: ptq" in out.getvalue() else "no help printed"
print(json.dumps(seen))
"""


def imported_after(argvs: list[list[str]]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(argvs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_help_imports_no_heavy_package():
    commands = [c for c in SUBCOMMANDS if c != "calibrate"]
    argvs = [["--help"]] + [[c, "--help"] for c in commands] + [["table", "show", "--help"], ["calibrate", "--help"]]
    seen = imported_after(argvs)
    calibrate = seen.pop("calibrate --help")
    assert seen == {"import ptq": [], "--help": [], **{f"{c} --help": [] for c in commands}, "table show --help": []}
    # the calibrators' epilog: numpy and the calibrators, still nothing that runs a model
    assert calibrate == ["calibrators", "numpy"]


def test_calibrate_help_lists_calibrators_and_targets():
    done = subprocess.run([sys.executable, "-m", "ptq.cli", "calibrate", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    epilog = done.stdout.split("calibrators (names are case-insensitive", 1)[1]
    assert "\n  kld: " in epilog and "\n  nstd (3std, 2.5std): " in epilog
    assert "QDQ targets (--target):\n  ort-cpu " in epilog and "\n  ort-cpu-vnni " in epilog
