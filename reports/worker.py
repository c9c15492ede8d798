"""The report's background thread: metric updates and isolated runs, kept a bounded number of images behind."""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class MetricWorker:
    """One background thread for the metric updates and the isolated runs, which overlap the
    integer graph running in the calling thread (onnxruntime, numpy and the compiled comparisons release the GIL).
    Tasks run in submission order. `settle()` closes an image; once more than LAG images are open it waits for the
    oldest one's tasks and re-raises their errors (each open image holds its float tensors)."""

    LAG = 3

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self.current: list[Future] = []
        self.open: deque[list[Future]] = deque()

    def submit(self, fn: Callable, *args) -> Future:
        future = self.pool.submit(fn, *args)
        self.current.append(future)
        return future

    def settle(self, keep: Optional[int] = None) -> None:
        """Close the current image; wait for the oldest open images until at most `keep` (default LAG) are open."""
        self.open.append(self.current)
        self.current = []
        while len(self.open) > (self.LAG if keep is None else keep):
            for future in self.open.popleft():
                future.result()
