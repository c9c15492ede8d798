"""Close matches for a name a user typed (a tensor, a node, an op type): the error says "did you mean ...".

Exporters' names are long (`p2o.pd_op.batch_norm_.5.0`, `/features/features.3/conv/conv.0/Conv_output_0`) and
users type a part of them, so the names that contain what was typed come first, then the closest spellings
(`difflib`)."""
from __future__ import annotations

import difflib
from typing import Iterable

SUGGESTIONS = 3


def close_names(name: str, candidates: Iterable[str], n: int = SUGGESTIONS) -> list[str]:
    """Up to `n` of `candidates`: those containing `name` (shortest first), then the closest by difflib; case
    does not matter (`gem` finds the op type `Gemm` and the node `gemm`)."""
    pool = sorted(set(c for c in candidates if c))
    typed = name.lower()
    containing = sorted((c for c in pool if typed and typed in c.lower()), key=lambda c: (len(c), c))
    by_lower: dict[str, list[str]] = {}
    for c in pool:
        by_lower.setdefault(c.lower(), []).append(c)
    similar = [c for lower in difflib.get_close_matches(typed, list(by_lower), n=n) for c in by_lower[lower]]
    return list(dict.fromkeys(containing + similar))[:n]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """"; did you mean 'a', 'b'?" for the close names, or "" when none is close."""
    close = close_names(name, candidates)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
