"""`ptq.engine.compile_notice`: the first integer run of a process that takes long says the kernels are compiling."""
import logging
import threading
import time

import pytest

from ptq.engine import compile_notice
from ptq.cli import main


@pytest.fixture
def fresh_process(monkeypatch):
    """A process in which no integer run has happened yet."""
    monkeypatch.setattr(compile_notice, "_first_run_seen", threading.Event())


def _notices(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ptq.kernels"]


def test_a_slow_first_run_logs_the_notice_once(fresh_process, caplog):
    caplog.set_level(logging.INFO, logger="ptq.kernels")
    with compile_notice.first_run_notice(after=0.01):
        time.sleep(0.3)
    with compile_notice.first_run_notice(after=0.01):  # a later run of the same process, as slow: no notice
        time.sleep(0.3)
    assert _notices(caplog) == [compile_notice.MESSAGE]


def test_a_quick_first_run_logs_nothing(fresh_process, caplog):
    caplog.set_level(logging.INFO, logger="ptq.kernels")
    with compile_notice.first_run_notice(after=0.5):
        pass
    time.sleep(0.7)  # past the delay: the cancelled timer stays silent
    assert _notices(caplog) == []


@pytest.mark.parametrize("quiet", [False, True])
def test_the_command_line_shows_the_notice_unless_quiet(quiet, tmp_path, monkeypatch):
    """`ptq` sets the notice's logger to INFO, or leaves it to --quiet's silence (the run itself fails early
    here: the model does not exist)."""
    monkeypatch.setattr(logging.getLogger("ptq.kernels"), "level", logging.NOTSET)
    argv = ["run", str(tmp_path / "missing.onnx"), "--quant", str(tmp_path / "missing.quant.json"), "--images",
            str(tmp_path)] + (["--quiet"] if quiet else [])
    assert main(argv) == 2
    assert logging.getLogger("ptq.kernels").level == (logging.NOTSET if quiet else logging.INFO)
