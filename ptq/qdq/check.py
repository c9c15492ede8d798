"""How the exported QDQ model fares in onnxruntime: its outputs against the float model's, with onnxruntime's
graph optimizations off (the QDQ graph's own arithmetic, op by op) and at onnxruntime's default (ORT_ENABLE_ALL:
QDQ groups fused into integer kernels, which is what a user deploying the model gets).

    cosine = mean over samples and graph outputs of cos(float output, QDQ output)

(an index or boolean output, ArgMax tags or a mask, counts by the fraction of its values equal to float's: the
cosine of two index vectors says nothing).

The two figures should agree: a gap above `TOLERANCE` means the fused kernels of this machine do not compute
what the QDQ graph describes (see docs/qdq_targets.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import onnx

from ptq.engine.threads import session_errors, session_options

# imports inside functions: onnxruntime, where a session is made: its import starts a thread, and a process
# that has loaded it no longer forks workers (`ptq.parallel.workers.fork_is_safe`)

CHECK_SAMPLES = 8  # calibration samples the check runs: enough to see a kernel's saturation, cheap
TOLERANCE = 0.002


class QDQCheckError(RuntimeError):
    """onnxruntime cannot run the check (no CPU provider, or it rejects one of the models)."""


@dataclass(frozen=True)
class QDQCheck:
    target: str
    samples: int
    cosine_unoptimized: float
    cosine_optimized: float
    source: str = "calibration"  # which samples ran, as the summary names them ("": just "samples")

    @property
    def gap(self) -> float:
        return abs(self.cosine_unoptimized - self.cosine_optimized)

    @property
    def holds(self) -> bool:
        return self.gap <= TOLERANCE

    def summary(self) -> str:
        source = f"{self.source} " if self.source else ""
        return (f"QDQ model in onnxruntime (target {self.target}), output cosine to float on {self.samples} "
                f"{source}sample{'s' if self.samples != 1 else ''}: {self.cosine_unoptimized:.4f} with graph "
                f"optimizations off, {self.cosine_optimized:.4f} with the default (on)")

    def warning(self) -> Optional[str]:
        """None when both figures agree within TOLERANCE; otherwise what happened and what to do."""
        if self.holds:
            return None
        advice = ("run it with SessionOptions.graph_optimization_level = ORT_ENABLE_BASIC (no fused integer "
                  "kernels)" if self.target == "ort-cpu" else
                  "--qdq-target ort-cpu stores the weights as uint8, whose fused kernels do not saturate")
        return (f"onnxruntime's optimized run of the QDQ model loses accuracy: output cosine to float "
                f"{self.cosine_optimized:.4f} against {self.cosine_unoptimized:.4f} unoptimized (gap "
                f"{self.gap:.4f} > {TOLERANCE}); its fused kernels do not compute the QDQ arithmetic exactly on "
                f"this machine; {advice}")



def _session(model: onnx.ModelProto, optimize: bool):
    import onnxruntime as ort

    options = session_options()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def qdq_session(model: onnx.ModelProto, optimize: bool):
    """An onnxruntime CPU session of `model`, graph optimizations at the default (`optimize`) or off; a
    `QDQCheckError` when onnxruntime has no CPU provider or rejects the model."""
    if not has_cpu_provider():
        raise QDQCheckError("onnxruntime has no CPUExecutionProvider")
    try:
        return _session(model, optimize)
    except session_errors() as exc:
        raise QDQCheckError(str(exc).splitlines()[0]) from exc


def run_session(session, feed: dict) -> dict:
    """One run of `session` on `feed`: output name -> array, in the model's output order; a `QDQCheckError` when
    onnxruntime fails."""
    try:
        values = session.run(None, feed)
    except session_errors() as exc:
        raise QDQCheckError(str(exc).splitlines()[0]) from exc
    return dict(zip((o.name for o in session.get_outputs()), values))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    if not np.issubdtype(np.asarray(a).dtype, np.floating):  # indices, booleans: agreement (module docstring)
        return float(np.mean(np.asarray(a) == np.asarray(b))) if np.size(a) else 1.0
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    norm = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / norm) if norm > 0 else float(np.array_equal(a, b))


def has_cpu_provider() -> bool:
    import onnxruntime as ort

    return "CPUExecutionProvider" in ort.get_available_providers()


def check_qdq(float_model: onnx.ModelProto, qdq: onnx.ModelProto, feeds: Sequence[dict], target: str,
              source: str = "calibration") -> QDQCheck:
    """Both figures of the module docstring over `feeds` (dicts of input name -> array, one run each), taken
    from `source` (what the summary calls them: "calibration", "tuning", "" for samples given to check)."""
    if not feeds:
        raise QDQCheckError("no samples to run")
    if not has_cpu_provider():
        raise QDQCheckError("onnxruntime has no CPUExecutionProvider")
    try:
        sessions = [_session(float_model, optimize=True), _session(qdq, optimize=False), _session(qdq, optimize=True)]
        runs = [[session.run(None, feed) for feed in feeds] for session in sessions]
    except session_errors() as exc:
        raise QDQCheckError(str(exc).splitlines()[0]) from exc
    reference, unoptimized, optimized = runs
    figures = [float(np.mean([_cosine(f, q) for ref, got in zip(reference, run) for f, q in zip(ref, got)]))
               for run in (unoptimized, optimized)]
    return QDQCheck(target, len(feeds), *figures, source)


def cosine_of_outputs(reference: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> float:
    """One sample's figure of the module docstring: the mean over graph outputs (in order) of their cosines."""
    return float(np.mean([_cosine(f, q) for f, q in zip(reference, outputs)]))
