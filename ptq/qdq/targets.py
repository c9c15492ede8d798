"""The runtimes a QDQ model can be stored for (`ptq calibrate --target`; what each changes is in
`ptq.qdq.export`'s docstring). A module of its own so that the command line lists them without importing onnx."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class QDQTarget:
    """A runtime the QDQ model is meant for and the storage that keeps its arithmetic exact there."""

    name: str
    description: str
    unsigned_weights: bool  # 8-bit signed weights stored as uint8, codes and zero point + 128 (same values)
    unsigned_activations: bool  # the same for 8-bit signed activations


QDQ_TARGETS = {
    t.name: t
    for t in (
        QDQTarget("ort-cpu", "onnxruntime's CPU provider on any CPU: 8-bit weights and activations stored as "
                             "uint8 (zero point + 128, same values); its fused uint8 x uint8 kernels do not "
                             "saturate", True, True),
        QDQTarget("ort-cpu-vnni", "onnxruntime's CPU provider on an x86 CPU with VNNI (avx512_vnni, avx_vnni): "
                                  "uint8 activations, int8 weights (faster uint8 x int8 kernels, which saturate "
                                  "without VNNI)", False, True),
        QDQTarget("none", "codes stored as the table has them (int8 weights), for any other runtime", False, False),
    )
}
DEFAULT_TARGET = "ort-cpu"


def get_target(target: Union[str, QDQTarget]) -> QDQTarget:
    """A target by name (case-insensitive) or as given."""
    if isinstance(target, QDQTarget):
        return target
    found = QDQ_TARGETS.get(str(target).lower())
    if found is None:
        raise ValueError(f"unknown QDQ target {target!r}; available: {', '.join(QDQ_TARGETS)}")
    return found
