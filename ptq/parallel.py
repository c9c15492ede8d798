"""Image work in shards on worker processes (`LocalPool`) or a Ray cluster (`ptq.ray_backend.RayPool`),
merged in image order so that the result is the one-process result, bit for bit.

The one-process run uses the first `limit` decodable candidates, grouped in batches of `batch_size` in
candidate order; a batch's float outputs (and the `mean` calibrator's per-batch extrema, and the order in
which floating-point sums are folded) depend on exactly which images it holds. So a shard is a run of
whole batches of that layout, and the shards' results are merged in shard order.

Which candidates are decodable is only known once a worker has tried them, so the layout is first planned
optimistically (every candidate readable). A worker that cannot decode an image of its shard reports it
(and computes nothing); the driver re-plans without that image and re-runs only the shards whose content
changed (the shards before the first unreadable image keep their results). Unreadable images are rare,
so the usual cost is nothing; the skipped list and count are exactly the one-process ones.

A job (`ShardJob`) is shipped to every worker once: `setup()` loads the model there (initializer), then
`run(context, item)` computes one item (a shard, or a (call, shard) pair when one pool serves several calls:
`ptq debug`, `ptq tune`). Workers run OpenBLAS and onnxruntime on one thread. The job travels pickled
to bytes: a process's start-up arguments are written to it through a pipe, and a job unpickled there would
make the driver wait for each worker's imports before starting the next one (the workers start together).

How many workers (`choose_workers`): what --workers asks for; by default the usable cores, but no more workers
than shards of MIN_IMAGES_PER_WORKER images, so a handful of images runs in one process (a worker's start-up,
about 3 s of CPU for imports, the model and the compiled kernels, is the work of 20-60 images).
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, Union

from ptq.image_log import ImageLog

DEFAULT_POOL_RESTARTS = 3
# small shards balance the load (the run ends when the last shard does) and re-run little after a crash; a
# shard's fixed cost is nil once a worker keeps its prepared graph and float session (a report shard of 1
# image took 0.14 s of CPU, of 5 images 0.72 s), so 8 per worker: 200 report images wait ~6 images at the end
SHARDS_PER_WORKER = 8
MIN_IMAGES_PER_WORKER = 50  # by default, a worker is started for each 50 images, up to the usable cores


@dataclass(frozen=True)
class Shard:
    """Whole batches of image files, in candidate order; `start` is the index of its first image among the
    images used. The first `isolated` images also get the report's isolated metrics."""

    start: int
    batches: tuple[tuple[Path, ...], ...]
    isolated: int = 0

    @property
    def images(self) -> int:
        return sum(len(b) for b in self.batches)


@dataclass
class ShardResult:
    """A shard's payload, or (payload None) the files it could not decode with the reasons."""

    payload: Any = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)


class ShardJob(Protocol):
    """What a worker runs: `setup()` once per worker process, then `run(context, item)` per item (a shard,
    or whatever the job's items are)."""

    def setup(self) -> Any: ...

    def run(self, context: Any, item: Any) -> ShardResult: ...


class ShardRunner(Protocol):
    def map(self, items: Sequence[Any]) -> Iterator[tuple[Any, ShardResult]]: ...


@dataclass
class CallRunner:
    """The shards of one call on a pool that serves several: each shard goes out as (call, shard), and comes
    back as the shard (`run_sharded` sees a plain runner)."""

    runner: ShardRunner
    call: Any

    def map(self, shards: Sequence[Shard]) -> Iterator[tuple[Shard, ShardResult]]:
        for (_, shard), result in self.runner.map([(self.call, s) for s in shards]):
            yield shard, result


class QuietLog(ImageLog):
    """A log that does not warn: a worker's (the driver warns about unreadable images, once, in candidate
    order), or one that only counts the candidates."""

    def skip(self, path: Path, reason: str) -> None:
        self.skipped.append((path, reason))


def plan_shards(used: Sequence[Path], batch_size: int, shard_batches: int, isolated: int = 0) -> list[Shard]:
    """`used` in batches of `batch_size`, `shard_batches` batches per shard; the first `isolated` images
    of `used` are marked for isolated metrics."""
    if batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {batch_size}")
    batches = [tuple(used[k:k + batch_size]) for k in range(0, len(used), batch_size)]
    shards = []
    start = 0
    for k in range(0, len(batches), shard_batches):
        group = tuple(batches[k:k + shard_batches])
        shard = Shard(start, group, max(0, min(isolated - start, sum(len(b) for b in group))))
        shards.append(shard)
        start += shard.images
    return shards


def optimistic_used(candidates: Sequence[Path], failed: dict, limit: Optional[int]) -> list[Path]:
    """The candidates not known to be unreadable, cut at `limit`: the images a one-process run uses if
    every candidate not yet tried is readable."""
    used = []
    for path in candidates:
        if limit is not None and len(used) >= limit:
            break
        if path not in failed:
            used.append(path)
    return used


def shard_batches_for(images: int, batch_size: int, workers: int) -> int:
    """Batches per shard: about SHARDS_PER_WORKER shards per worker."""
    batches = -(-images // batch_size)
    return max(1, -(-batches // (workers * SHARDS_PER_WORKER)))


def run_sharded(
    runner: ShardRunner,
    candidates: Sequence[Path],
    log: ImageLog,
    *,
    limit: Optional[int],
    batch_size: int,
    shard_batches: int,
    isolated: int = 0,
    on_shard=None,
) -> list:
    """The payloads of the shards of the one-process layout, in shard order; `log` gets the images used and,
    in candidate order, the unreadable ones (with the usual warning). `on_shard(images)` reports progress."""
    failed: dict[Path, str] = {}
    done: dict[Shard, Any] = {}
    while True:
        used = optimistic_used(candidates, failed, limit)
        shards = plan_shards(used, batch_size, shard_batches, isolated)
        todo = [s for s in shards if s not in done]
        if not todo:
            break
        for shard, result in runner.map(todo):
            if result.skipped:
                failed.update(result.skipped)
            else:
                done[shard] = result.payload
                if on_shard is not None:
                    on_shard(shard.images)
    position = {path: k for k, path in enumerate(candidates)}
    # a one-process run stops trying candidates once it has `limit` images
    cut = position[used[-1]] if limit is not None and len(used) == limit else len(candidates)
    for path in candidates:
        if path in failed and position[path] <= cut:
            log.skip(path, failed[path])
    log.used.extend(used)
    return [done[s] for s in shards]


ShippedModel = Union[str, bytes]  # what a job carries to its workers: a model file's absolute path, or the model


def ship_model(model) -> ShippedModel:
    """A model path (made absolute: workers may start elsewhere) or an in-memory `onnx.ModelProto`, serialized."""
    return str(Path(model).resolve()) if isinstance(model, (str, Path)) else model.SerializeToString()


def load_shipped_model(model: ShippedModel, input_shapes: Optional[dict]):
    """In a worker: the `ptq.core.graph.Graph` of a shipped model (onnx is loaded here, not at import, which
    the command line pays for)."""
    import onnx

    from ptq.core.graph import load_model

    return load_model(model if isinstance(model, str) else onnx.load_from_string(model), input_shapes)


# ---------------------------------------------------------------------------------------------- local pool

_WORKER: dict = {}  # in a worker process: the job and its context


ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """The environment processes spawned meanwhile inherit: one BLAS thread (OpenBLAS reads it when numpy
    loads, before any code of ours runs in the child), a value the user set is kept; and SIGINT blocked.
    Ctrl-C is the driver's: a child inherits the blocked signal through exec, so one that is still importing
    when Ctrl-C comes prints no traceback (`_init_worker` then ignores it for good), while the driver gets a
    Ctrl-C that arrived meanwhile as soon as the signal is unblocked."""
    saved = {name: os.environ.get(name) for name in ONE_BLAS_THREAD}
    for name, value in ONE_BLAS_THREAD.items():
        os.environ.setdefault(name, value)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for name, value in saved.items():
            if value is None:
                del os.environ[name]


def _leave_now() -> None:
    """A worker's last step (atexit, once the pool has told it to stop: every result is sent): leave without
    tearing down the interpreter, which the driver would wait for (numba, onnxruntime, hundreds of MB:
    1.9 s at load 10, 5 s at load 18)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _init_worker(job: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it stops the workers
    atexit.register(_leave_now)
    _WORKER["job"] = pickle.loads(job)
    _WORKER["context"] = _WORKER["job"].setup()


def _run_in_worker(item: Any) -> ShardResult:
    return _WORKER["job"].run(_WORKER["context"], item)


class LocalPool:
    """`workers` spawned processes, each set up once with the job. A worker that dies (the pool breaks)
    costs a new pool, and the shards not finished are queued again, up to `restarts` times."""

    def __init__(self, job: ShardJob, workers: int, restarts: int = DEFAULT_POOL_RESTARTS):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        self.job, self.workers, self.restarts = job, workers, restarts
        self.pool: Optional[ProcessPoolExecutor] = None
        self.crashes = 0

    def __enter__(self) -> "LocalPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(abort=exc_type is not None)

    def _executor(self) -> ProcessPoolExecutor:
        if self.pool is None:
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_worker, initargs=(pickle.dumps(self.job),))
        return self.pool

    def _close(self, abort: bool) -> None:
        if self.pool is None:
            return
        if abort:  # interrupted or failed: do not wait for the running shards
            processes = list((self.pool._processes or {}).values())  # the executor has no public handle
            self.pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
        else:
            self.pool.shutdown(wait=True)  # quick: a worker skips its interpreter's teardown (`_leave_now`)
        self.pool = None

    def map(self, items: Sequence[Any]) -> Iterator[tuple[Any, ShardResult]]:
        """(item, result) as the items finish; every item exactly once."""
        items = list(items)
        pending = set(range(len(items)))  # by position: items need not be comparable
        while pending:
            pool = self._executor()
            with worker_environment():  # the executor spawns its processes in submit()
                futures = {pool.submit(_run_in_worker, items[k]): k for k in sorted(pending)}
            broken = False
            waiting = set(futures)
            while waiting:
                finished, waiting = wait(waiting, return_when=FIRST_COMPLETED)
                for future in finished:
                    try:
                        result = future.result()
                    except BrokenProcessPool:
                        broken = True
                        continue
                    pending.discard(futures[future])
                    yield items[futures[future]], result
            if broken:
                self._close(abort=True)
                self.crashes += 1
                if self.crashes > self.restarts:
                    raise RuntimeError(f"worker processes died {self.crashes} times; giving up")


def make_runner(job: ShardJob, workers: int, ray: Optional[str] = None):
    """A `LocalPool`, or with `ray` ('auto', an address, or 'local' for a cluster in this process) a
    `RayPool`; both are context managers."""
    if ray is not None:
        from ptq.ray_backend import RayPool

        return RayPool(job, ray)
    return LocalPool(job, workers)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def choose_workers(requested: Optional[int], images: int) -> int:
    """`requested` when given (--workers N); else the usable cores, but no more than one worker per
    MIN_IMAGES_PER_WORKER images (at least 1): below that a worker's start-up costs more than it saves."""
    if requested is not None:
        return requested
    return max(1, min(usable_cores(), images // MIN_IMAGES_PER_WORKER))


def add_parallel_arguments(parser) -> None:
    """--workers and --ray, for the commands that stream images."""
    group = parser.add_argument_group("scale-out (same result as one process)")
    group.add_argument("--workers", type=positive_workers, default=None, metavar="N",
                       help=f"worker processes, each on shards of the images (default: the usable cores, one "
                       f"per {MIN_IMAGES_PER_WORKER} images: fewer images run in one process)")
    group.add_argument("--ray", metavar="auto|ADDRESS|local",
                       help="run the shards as Ray tasks: on the cluster at ADDRESS, the running one ('auto'), or "
                       "a cluster started in this process ('local'); needs `pip install ptq[ray]`")


def positive_workers(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
