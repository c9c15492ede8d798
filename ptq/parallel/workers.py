"""Image work in shards on worker processes (`LocalPool`) or a Ray cluster (`ptq.parallel.ray_backend.RayPool`),
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
`ptq debug`, `ptq tune`). Workers run OpenBLAS and onnxruntime on one thread.

How a local worker starts (`start_method`): on Linux by fork when the driver is safe to fork (no thread of
its own besides BLAS's, no onnxruntime loaded, no numba thread pool: `fork_is_safe`), which the command line's
driver is when the pool starts (`LocalPool.__enter__`, before its progress bar's thread). A forked worker
inherits the imported modules and the job as it is in the driver (a `ptq report` job carries the loaded
model): it starts in about 1 s of CPU (the compiled kernels and the float session) instead of about 3 s
(a fresh interpreter importing numpy, onnxruntime and ptq and loading the model). Elsewhere (macOS, Windows),
from a driver with threads, and for a pool re-started after a crash inside the run (the progress bar's
thread runs by then), workers are spawned: the job then travels pickled to bytes (a process's start-up
arguments are written to it through a pipe, and a job unpickled there would make the driver wait for each
worker's imports before starting the next one).

How many workers (`choose_workers`): what --workers asks for; by default the usable cores, but no more workers
than shards of MIN_IMAGES_PER_WORKER images, so a handful of images runs in one process (a worker's start-up,
about 3 s of CPU for imports, the model and the compiled kernels, is the work of 20-60 images), and one process
rather than fewer than MIN_WORKERS workers (one process keeps about 1.7 cores busy by itself).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol, Sequence, Union

from threadpoolctl import threadpool_info, threadpool_limits

from ptq.data.image_log import ImageLog
from ptq.engine.threads import usable_cores
from ptq.core.notes import Note

DEFAULT_POOL_RESTARTS = 3
# small shards balance the load (the run ends when the last shard does) and re-run little after a crash; a
# shard's fixed cost is nil once a worker keeps its prepared graph and float session (a report shard of 1
# image took 0.14 s of CPU, of 5 images 0.72 s), so 8 per worker: 200 report images wait ~6 images at the end
SHARDS_PER_WORKER = 8
MIN_IMAGES_PER_WORKER = 50  # by default, a worker is started for each 50 images, up to the usable cores
# and only from 3 workers on: one process already keeps about 1.7 cores busy (the report's float and metric threads,
# calibration's onnxruntime threads), so 2 workers take at best 1.7/2 of its time and add their start-up CPU
# (a report of 200 images on 2 quiet cores: 0.95x the wall time of one process at 1.04x its CPU, bench/scale.py)
MIN_WORKERS = 3


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


def plan_shards(used: Sequence[Path], batch_size: int, shard_batches: Union[int, Sequence[int]],
                isolated: int = 0) -> list[Shard]:
    """`used` in batches of `batch_size`, `shard_batches` batches per shard (a sequence: the sizes of the
    successive shards, the last one repeated); the first `isolated` images of `used` are marked for isolated
    metrics."""
    if batch_size <= 0:
        raise ValueError(f"--batch-size must be positive, got {batch_size}")
    sizes = [shard_batches] if isinstance(shard_batches, int) else list(shard_batches)
    batches = [tuple(used[k:k + batch_size]) for k in range(0, len(used), batch_size)]
    shards = []
    start = k = 0
    while k < len(batches):
        size = sizes[min(len(shards), len(sizes) - 1)]
        group = tuple(batches[k:k + size])
        shard = Shard(start, group, max(0, min(isolated - start, sum(len(b) for b in group))))
        shards.append(shard)
        start += shard.images
        k += size
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


def guided_shard_batches(images: int, batch_size: int, workers: int) -> list[int]:
    """Batches per shard, shrinking (guided self-scheduling): each shard a 1/(2 x workers) share of the batches
    not yet planned, so the run starts with large shards and ends with shards of one batch: the worker that
    finishes last waits a batch, not a whole shard (with 8 shards of 13 images per worker: up to 13 images of
    200). The sizes are fixed from the expected count, so a shard keeps its images when the plan changes
    after it (an unreadable image further on)."""
    left, sizes = -(-images // batch_size), []
    while left > 0:
        sizes.append(max(1, -(-left // (2 * workers))))
        left -= sizes[-1]
    return sizes or [1]


def run_sharded(
    runner: ShardRunner,
    candidates: Sequence[Path],
    log: ImageLog,
    *,
    limit: Optional[int],
    batch_size: int,
    shard_batches: Union[int, Sequence[int]],
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
    import onnx  # the command line's parser imports this module (--workers): onnx is loaded at first use

    from ptq.core.graph import load_model  # it imports numpy and onnx: as above

    return load_model(model if isinstance(model, str) else onnx.load_from_string(model), input_shapes)


# ---------------------------------------------------------------------------------------------- local pool

_WORKER: dict = {}  # in a worker process: the job and its context


ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def worker_environment() -> Iterator[None]:
    """The environment processes started meanwhile inherit: one BLAS thread (a spawned child's OpenBLAS reads
    it when numpy loads, before any code of ours runs there; a forked child applies it with threadpoolctl), a
    value the user set is kept; and SIGINT blocked. Ctrl-C is the driver's: a child inherits the blocked signal
    (through fork, and exec), so one that is still starting when Ctrl-C comes prints no traceback
    (`_init_worker` then ignores it for good), while the driver gets a Ctrl-C that arrived meanwhile as soon as
    the signal is unblocked."""
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


def _init_worker(job: Union[bytes, "ShardJob"]) -> None:
    """A worker's start: a spawned one gets the job pickled, a forked one the driver's job object itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it stops the workers
    atexit.register(_leave_now)  # a spawned worker's exit (a forked one leaves by os._exit anyway)
    if isinstance(job, bytes):
        job = pickle.loads(job)
    else:  # forked: numpy was loaded in the driver, before the environment asked for one BLAS thread
        threadpool_limits(int(os.environ["OPENBLAS_NUM_THREADS"]), user_api="blas")
    _WORKER["job"] = job
    _WORKER["context"] = job.setup()


def fork_is_safe() -> bool:
    """Whether this process may fork workers that go on running numpy, numba and onnxruntime: it runs no other
    Python thread (a fork copies only the calling thread, and a lock another one holds stays held in the child),
    has not loaded onnxruntime (its import starts a thread, its sessions thread pools) nor started numba's thread
    pool; BLAS threads are fine when they are OpenBLAS's pthreads (OpenBLAS stops them at fork) or there is one."""
    if threading.active_count() > 1 or "onnxruntime" in sys.modules:
        return False
    numba_threads = sys.modules.get("numba.np.ufunc.parallel")
    if numba_threads is not None and getattr(numba_threads, "_is_initialized", True):
        return False
    if "numpy" not in sys.modules:
        return True
    return all(lib["num_threads"] == 1 or (lib["internal_api"] == "openblas" and lib["threading_layer"] == "pthreads")
               for lib in threadpool_info())


def start_method() -> str:
    """'fork' on Linux from a driver that is safe to fork (`fork_is_safe`), else 'spawn' (macOS's system
    libraries are not fork-safe, Windows has no fork)."""
    if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods() and fork_is_safe():
        return "fork"
    return "spawn"


def _run_in_worker(item: Any) -> ShardResult:
    return _WORKER["job"].run(_WORKER["context"], item)


class LocalPool:
    """`workers` processes (forked or spawned: `start_method`), each set up once with the job. A worker that
    dies (the pool breaks) costs a new pool, and the shards not finished are queued again, up to `restarts`
    times. Entering the pool starts the workers: a driver forks before it starts threads of its own."""

    def __init__(self, job: ShardJob, workers: int, restarts: int = DEFAULT_POOL_RESTARTS):
        if workers < 1:
            raise ValueError(f"--workers must be at least 1, got {workers}")
        self.job, self.workers, self.restarts = job, workers, restarts
        self.pool: Optional[ProcessPoolExecutor] = None
        self.crashes = 0
        self.methods: list[str] = []  # how each pool of this run started its workers ('fork' or 'spawn')

    def __enter__(self) -> "LocalPool":
        try:
            self._executor()
        except BaseException:  # Ctrl-C comes when the start unblocks it: `__exit__` will not run, stop them here
            self._close(abort=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(abort=exc_type is not None)

    def _executor(self) -> ProcessPoolExecutor:
        if self.pool is None:
            method = start_method()
            job = self.job if method == "fork" else pickle.dumps(self.job)
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(method),
                                            initializer=_init_worker, initargs=(job,))
            self.methods.append(method)
            with worker_environment():  # the processes start with the first task, now: before any thread here
                self.pool.submit(os.getpid)
        return self.pool

    def _close(self, abort: bool) -> None:
        """`abort`: do not wait for the running shards (terminate the workers), but wait for the pool's own
        thread to end, which it does at once once the workers are gone. That thread closes the pool's wake-up
        pipe as it ends: left running, it races the interpreter's exit, whose hook writes to that pipe
        (`concurrent.futures.process._python_exit` checks that the pipe is open, then writes without the
        pool's lock), and a Ctrl-C ended with a traceback after `interrupted` ("Bad file descriptor", or
        "'NoneType' object cannot be interpreted as an integer" once the connection dropped its handle).
        Joined, it also lets this driver fork the next pool after a crash."""
        if self.pool is None:
            return
        if abort:  # interrupted or failed: do not wait for the running shards
            processes = list((self.pool._processes or {}).values())  # the executor has no public handle
            manager = self.pool._executor_manager_thread
            self.pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()
            if manager is not None:
                manager.join()
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




def choose_workers(requested: Optional[int], images: int) -> int:
    """`requested` when given (--workers N); else the usable cores, but no more than one worker per
    MIN_IMAGES_PER_WORKER images (below that a worker's start-up costs more than it saves), and one process
    where that leaves fewer than MIN_WORKERS workers (one process keeps about 1.7 cores busy already)."""
    if requested is not None:
        if requested > 1 and images < requested * MIN_IMAGES_PER_WORKER:
            warnings.warn(f"--workers {requested} on {images} samples: a worker's start-up is the work of 20-60 "
                          f"samples, so one process is likely faster below {requested * MIN_IMAGES_PER_WORKER} "
                          f"(without --workers ptq starts one per {MIN_IMAGES_PER_WORKER} samples)", Note)
        return requested
    workers = min(usable_cores(), images // MIN_IMAGES_PER_WORKER)
    return workers if workers >= MIN_WORKERS else 1


def add_parallel_arguments(parser) -> None:
    """--workers and --ray, for the commands that stream images."""
    group = parser.add_argument_group("scale-out (same result as one process)")
    group.add_argument("--workers", type=positive_workers, default=None, metavar="N",
                       help=f"worker processes, each on shards of the images (default: the usable cores, one "
                       f"per {MIN_IMAGES_PER_WORKER} images, from {MIN_WORKERS} on: fewer images or cores run in "
                       "one process)")
    group.add_argument("--ray", metavar="auto|ADDRESS|local",
                       help="run the shards as Ray tasks: on the cluster at ADDRESS, the running one ('auto'), or "
                       "a cluster started in this process ('local'); needs `pip install ptq[ray]`")


def positive_workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
