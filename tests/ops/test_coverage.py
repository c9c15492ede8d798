"""Every registered op is tested: some test in tests/ops/ declares (`op_testing.covers`) that it compares the
op's float forward with onnxruntime or its integer forward with an independent reference, every declaration
names an op that is registered, and every module of ops/ that registers ops has its tests/ops/test_<module>.py.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from op_testing import Check, covers
from ops import REGISTRY

HERE = Path(__file__).resolve().parent

OpKey = tuple[str, str]  # (domain, op_type), as in ops.REGISTRY


def _name(key: OpKey) -> str:
    domain, op_type = key
    return f"{domain}::{op_type}" if domain else op_type


def op_test_modules() -> list[ModuleType]:
    """Every tests/ops/test_*.py but this one, as pytest imports them (by basename: tests/ops is on sys.path)."""
    modules = []
    for path in sorted(HERE.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        module = importlib.import_module(path.stem)
        if Path(module.__file__).resolve() != path:
            raise ImportError(f"{path.stem} resolves to {module.__file__}, not {path}: test file names must be unique")
        modules.append(module)
    return modules


def declared_coverage(modules: list[ModuleType]) -> dict[OpKey, dict[Check, list[str]]]:
    """op -> check -> the tests (module::function) that declare it."""
    declared: dict[OpKey, dict[Check, list[str]]] = {}
    for module in modules:
        for name, value in vars(module).items():
            for key, check in sorted(getattr(value, "op_coverage", ()), key=lambda kc: (kc[0], kc[1].name)):
                declared.setdefault(key, {}).setdefault(check, []).append(f"{module.__name__}::{name}")
    return declared


def coverage_problems(registered: set[OpKey], declared: dict[OpKey, dict[Check, list[str]]]) -> list[str]:
    """One line per registered op without a checked test, per declaration of an unregistered op, and per
    declaration on a function pytest does not collect as a test."""
    problems = [f"{_name(key)}: registered, but no test declares {' or '.join(c.name for c in Check)}"
                for key in sorted(registered) if not declared.get(key)]
    for key in sorted(declared):
        tests = sorted({t for found in declared[key].values() for t in found})
        if key not in registered:
            problems.append(f"{_name(key)}: declared by {', '.join(tests)} but not registered")
        problems += [f"{_name(key)}: declared on {t}, which is not a test function" for t in tests
                     if not t.rsplit("::", 1)[1].startswith("test")]
    return problems


def missing_test_files(registry: dict, folder: Path) -> list[str]:
    """One line per module registering ops (ops.<module>) without folder/test_<module>.py."""
    modules = sorted({type(op).__module__ for op in registry.values()})
    return [f"{m} registers ops but has no {folder.name}/test_{m.rsplit('.', 1)[1]}.py" for m in modules
            if not (folder / f"test_{m.rsplit('.', 1)[1]}.py").exists()]


def test_every_registered_op_has_an_onnxruntime_or_integer_reference_test():
    problems = coverage_problems(set(REGISTRY), declared_coverage(op_test_modules()))
    assert not problems, "\n".join(problems)


def without_integer_reference(registered: set[OpKey], declared: dict[OpKey, dict[Check, list[str]]]) -> list[str]:
    """The registered ops no test holds to an integer reference of their formula (Check.INT_REFERENCE)."""
    return [_name(key) for key in sorted(registered) if Check.INT_REFERENCE not in declared.get(key, {})]


def test_every_integer_forward_is_held_to_an_integer_reference():
    """The project's standard: each forward_int is tested exactly against an int64/Python-int reference."""
    declared = declared_coverage(op_test_modules())
    assert without_integer_reference(set(REGISTRY), declared) == []
    assert without_integer_reference({("", "A"), ("", "B")}, {("", "A"): {Check.ONNXRUNTIME: ["t"]}}) == ["A", "B"]


def test_an_untested_op_a_stale_declaration_and_a_declared_helper_are_named():
    module = ModuleType("synthetic_op_tests")

    @covers("Tested", check=Check.INT_REFERENCE)
    def test_tested():
        pass

    @covers("Removed", "Tested", check=Check.ONNXRUNTIME)
    def test_removed():
        pass

    @covers("Custom", check=Check.ONNXRUNTIME, domain="com.example")
    def helper():
        pass

    module.test_tested, module.test_removed, module.helper = test_tested, test_removed, helper
    declared = declared_coverage([module])
    assert declared[("", "Tested")] == {Check.INT_REFERENCE: ["synthetic_op_tests::test_tested"],
                                        Check.ONNXRUNTIME: ["synthetic_op_tests::test_removed"]}
    registered = {("", "Tested"), ("", "Untested"), ("com.example", "Custom")}
    assert coverage_problems(registered, declared) == [
        "Untested: registered, but no test declares ONNXRUNTIME or INT_REFERENCE",
        "Removed: declared by synthetic_op_tests::test_removed but not registered",
        "com.example::Custom: declared on synthetic_op_tests::helper, which is not a test function",
    ]
    assert coverage_problems({("", "Tested")}, declared_coverage([ModuleType("empty")])) == [
        "Tested: registered, but no test declares ONNXRUNTIME or INT_REFERENCE"]


def test_every_op_module_has_its_test_file(tmp_path):
    assert missing_test_files(REGISTRY, HERE) == []
    fake = {("", "Fake"): type("FakeOp", (), {"__module__": "ops.fake"})()}
    assert missing_test_files(fake, tmp_path) == [f"ops.fake registers ops but has no {tmp_path.name}/test_fake.py"]
    (tmp_path / "test_fake.py").write_text("")
    assert missing_test_files(fake, tmp_path) == []


def test_covers_rejects_a_missing_check_or_op_type():
    with pytest.raises(TypeError, match="must be a Check"):
        covers("Relu", check="onnxruntime")
    with pytest.raises(ValueError, match="one or more op type"):
        covers(check=Check.ONNXRUNTIME)
