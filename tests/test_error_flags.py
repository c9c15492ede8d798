"""Error messages name only flags the command has (issue 27, item 5): every message a `raise` or a warning
writes that names a `--flag` is walked, and each flag is checked against the commands that can raise it. A flag
of another command is named only inside a quoted command line, `ptq calibrate --input-shape ...`."""
import argparse
import ast
import re
from pathlib import Path

import pytest

from ptq.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
QUOTED_COMMAND = re.compile(r"`ptq ([a-z-]+)((?: [^`]*)?)`")

DATA = ("calibrate", "run", "report", "debug", "tune", "table export")
POOLED = ("calibrate", "run", "report", "debug", "tune")
# who can raise the messages of a module (the default: every command that reads samples)
MODULE_COMMANDS = {
    "ptq/table/edit.py": ("table set",),
    "ptq/commands/table.py": ("table set",),
    "ptq/commands/report.py": ("report",),
    "ptq/commands/debug.py": ("debug",),
    "ptq/commands/dsp_report.py": ("dsp-report",),
    "ptq/tuning/lane_mix.py": ("tune",),
    "ptq/tuning/goal.py": ("tune",),
    "ptq/commands/ops.py": ("ops",),
    "ptq/core/graph.py:parse_input_shapes": ("calibrate",),
    "ptq/parallel/workers.py": POOLED,
    "ptq/parallel/ray_backend.py": POOLED,
    "reports/auto_debug.py": ("debug",),
    "reports/dump.py": ("debug",),
    "reports/detections.py": ("report",),
}
# the check of a flag's own value, raised only when the flag is given: `ptq table export` has no --workers, and
# its data options (`ptq.data_options.DataOptions`) keep the default
VALUE_CHECKS = {("ptq/data_options.py", "--workers")}
API_FUNCTIONS = {"calibrate": ("calibrate",), "run": ("run",), "report": ("report",), "debug": ("debug",),
                 "tune": ("tune",), "_metric_target": ("tune",), "_trusted_labels": ("tune",),
                 "export_table": ("table export",)}


def command_flags() -> dict[str, set[str]]:
    """Each command (and `table ACTION`) -> its option strings."""
    flags = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        own = {s for a in parser._actions for s in a.option_strings}
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            flags[name] = own
        for sub in subs:
            for child, child_parser in sub.choices.items():
                walk(child_parser, f"{name} {child}".strip())

    walk(build_parser(), "")
    return flags


def messages() -> list[tuple[str, int, str, str]]:
    """(module, line, enclosing function, the message's literal text) for every raise and warning naming a flag."""
    found = []
    for root in ("ptq", "reports", "calibrators", "ops", "lut", "dsp"):
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            enclosing = {}  # node -> the innermost function it is in
            for function in ast.walk(tree):
                if isinstance(function, ast.FunctionDef):
                    for node in ast.walk(function):
                        if node is not function:
                            enclosing[node] = function.name  # inner functions come later in the walk: they win
            for node in ast.walk(tree):
                is_warning = isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("warn", "warning")
                if not (isinstance(node, ast.Raise) or is_warning):
                    continue
                text = "".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))
                if FLAG.search(text):
                    found.append((str(path.relative_to(REPO)), node.lineno, enclosing.get(node, ""), text))
    return found


def test_the_walk_finds_the_messages():
    found = {(module, function) for module, _, function, _ in messages()}
    assert ("ptq/data_options.py", "__post_init__") in found and ("ptq/core/graph.py", "load_model") in found
    assert ("ptq/api.py", "tune") in found


def test_every_flag_an_error_names_is_a_flag_of_each_command_that_can_raise_it():
    flags = command_flags()
    wrong = []
    for module, line, function, text in messages():
        if module == "ptq/api.py" and function in API_FUNCTIONS:
            commands = API_FUNCTIONS[function]
        else:
            commands = MODULE_COMMANDS.get(f"{module}:{function}", MODULE_COMMANDS.get(module, DATA))
        for quoted, rest in QUOTED_COMMAND.findall(text):  # `ptq calibrate --input-shape ...`: calibrate's flags
            wrong += [(module, line, quoted, f) for f in FLAG.findall(rest) if f not in flags[quoted]]
        plain = QUOTED_COMMAND.sub("", text)
        wrong += [(module, line, c, f) for c in commands for f in FLAG.findall(plain)
                  if f not in flags[c] and (module, f) not in VALUE_CHECKS]
    assert wrong == []


@pytest.mark.parametrize("command", ["run", "report", "tune"])
def test_a_dynamic_shape_model_names_the_command_that_takes_the_shape(tmp_path, capsys, command):
    """The table of the static model, used with a copy whose spatial dimensions are dynamic (issue 27: `ptq run`
    said `give them with --input-shape`, a flag it lacks)."""
    import numpy as np
    import onnx

    from ptq.cli import main
    from ptq.calibration.pipeline import calibrate
    from tiny_models import conv_relu_gemm

    static = conv_relu_gemm(batch=1)
    table = calibrate(static, np.random.default_rng(0).normal(size=(3, 3, 8, 8)).astype(np.float32),
                      tmp_path, write_qdq=False).table
    from ptq.table.quant_table import save_quant_table

    table_path = save_quant_table(table, tmp_path / "static.quant.json")
    dims = static.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "H", "W"
    onnx.save(static, tmp_path / "dynamic.onnx")
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "s.npy", np.zeros((1, 3, 8, 8), np.float32))
    extra = {"run": [], "report": ["--out", tmp_path / "r"], "tune": ["--target-cosine", "0.9"]}[command]
    argv = [command, tmp_path / "dynamic.onnx", "--quant", table_path, "--data", data, *extra]
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert "`ptq calibrate --input-shape input:1,3,224,224`" in err
    assert set(FLAG.findall(QUOTED_COMMAND.sub("", err))) <= command_flags()[command]
