"""Shards as Ray tasks (`--ray auto|ADDRESS|local`; `pip install ptq[ray]`).

The job (model path or bytes, quant table, preprocessing) is put in the object store once; each task gets
its reference and a shard. A Ray worker process sets the job up the first time it sees it and keeps it
for the next shards (Ray reuses worker processes); workers run OpenBLAS on one thread (runtime_env).
Scheduling, retries (`max_retries`: a task whose worker died runs again) and object transfer are Ray's. Images are read by the workers from their paths, so the
paths must be visible on every node (a shared file system, or the local machine).
"""
from __future__ import annotations

import uuid
from typing import Any, Iterator, Optional, Sequence

from ptq.parallel.workers import ONE_BLAS_THREAD, Shard, ShardJob, ShardResult

MAX_RETRIES = 3
_JOBS: dict[str, tuple[ShardJob, Any]] = {}  # in a Ray worker: job key -> (job, its set-up context)


def _import_ray():
    try:
        import ray  # an optional dependency (ptq[ray]), imported when --ray is given
    except ImportError as exc:
        raise ValueError("--ray needs Ray: pip install 'ptq[ray]'") from exc
    return ray


def _run_shard(key: str, job: ShardJob, shard: Shard) -> ShardResult:
    if key not in _JOBS:
        _JOBS.clear()  # one job at a time per worker: drop the previous model
        _JOBS[key] = (job, job.setup())
    job, context = _JOBS[key]
    return job.run(context, shard)


class RayPool:
    """Shards as Ray tasks of one CPU each. `address`: 'auto' (the running cluster), a cluster address, or
    'local' (start a cluster in this process); when Ray is already initialized, that cluster is used."""

    def __init__(self, job: ShardJob, address: Optional[str]):
        self.ray = _import_ray()
        self.started = False
        if not self.ray.is_initialized():
            self.ray.init(address=None if address == "local" else address, log_to_driver=False,
                          include_dashboard=False)
            self.started = True
        self.key = uuid.uuid4().hex
        self.job_ref = self.ray.put(job)
        self.task = self.ray.remote(num_cpus=1, max_retries=MAX_RETRIES,
                                    runtime_env={"env_vars": ONE_BLAS_THREAD})(_run_shard)

    def __enter__(self) -> "RayPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.started:
            self.ray.shutdown()

    def map(self, shards: Sequence[Shard]) -> Iterator[tuple[Shard, ShardResult]]:
        running = {self.task.remote(self.key, self.job_ref, shard): shard for shard in shards}
        try:
            while running:
                ready, _ = self.ray.wait(list(running), num_returns=1)
                shard = running.pop(ready[0])
                yield shard, self.ray.get(ready[0])
        finally:
            for ref in running:  # interrupted: the remaining shards are not wanted
                self.ray.cancel(ref)
