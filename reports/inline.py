"""The report's helper threads, or none: `background(True, name)` is a one-thread pool, `background(False, name)`
runs each task at once in the calling thread (a sharded report's worker on a busy core, `reports.evaluate`'s
`threads=False`), with the same `submit` -> `Future` interface."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Union


class InlineExecutor:
    """`submit(fn, *args)` runs `fn(*args)` now and returns its finished `Future` (an error is kept in it, raised by
    `result()`, as a pool thread's would be)."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001  (handed to the caller through the future, as a thread pool does)
            future.set_exception(exc)
        return future

    def __enter__(self) -> "InlineExecutor":
        return self

    def __exit__(self, *exc) -> None:
        return None


def background(threads: bool, name: str) -> Union[ThreadPoolExecutor, InlineExecutor]:
    """A one-thread pool named `name`, or with `threads=False` the calling thread itself."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if threads else InlineExecutor()
