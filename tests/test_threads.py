"""Every onnxruntime session ptq opens uses the threads it is given and does not spin (issue 29)."""
from __future__ import annotations

import os

from ptq.core.graph import load_model
from ptq.engine import threads
from ptq.engine.float_run import FloatRunner
from tiny_models import conv_relu_gemm


def _spinning(options) -> tuple[str, str]:
    return (options.get_session_config_entry("session.intra_op.allow_spinning"),
            options.get_session_config_entry("session.inter_op.allow_spinning"))


def test_session_options_take_the_given_threads_and_never_spin():
    options = threads.session_options(3)
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 1)
    assert _spinning(options) == ("0", "0")


def test_the_default_is_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    assert threads.usable_cores() == 3
    assert threads.session_options().intra_op_num_threads == 3


def test_the_float_runner_session_uses_them():
    graph = load_model(conv_relu_gemm())
    runner = FloatRunner.create(graph, graph.activations, intra_op_threads=1)
    options = runner.session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert _spinning(options) == ("0", "0")
