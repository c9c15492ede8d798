"""`OutputMetrics`: the model output's similarity to the float model over an evaluation, as the debug tools
compare it before and after a change (cosine, MSE, SQNR, top-1/top-5 agreement)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from reports.evaluation import Evaluation


@dataclass(frozen=True)
class OutputMetrics:
    cosine: float
    mse: float
    sqnr_db: float
    top1_agreement: Optional[float]
    top5_agreement: Optional[float]

    @classmethod
    def of(cls, ev: Evaluation) -> "OutputMetrics":
        if not ev.outputs:
            raise ValueError(f"the model's outputs are indices or booleans ({list(ev.index_outputs)}): `ptq report` "
                             "compares them by agreement; debugging and tuning measure a float output")
        sim = next(iter(ev.outputs.values())).result()
        c = ev.classification
        top1 = top5 = None
        if c is not None and c.samples:
            top1 = c.top1_agree / c.samples
            top5 = c.topk_agree / c.samples if c.meaningful_topk else None
        return cls(sim.cosine, sim.mse, sim.sqnr_db, top1, top5)

    def to_dict(self) -> dict:
        return {"cosine": self.cosine, "mse": self.mse, "sqnr_db": self.sqnr_db,
                "top1_agreement": self.top1_agreement, "top5_agreement": self.top5_agreement}

    def line(self) -> str:
        text = f"cosine {self.cosine:.6f}  sqnr {self.sqnr_db:.2f} dB"
        if self.top1_agreement is not None:
            text += f"  top-1 agreement {self.top1_agreement:.3f}"
        if self.top5_agreement is not None:
            text += f"  top-5 agreement {self.top5_agreement:.3f}"
        return text
