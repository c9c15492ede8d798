"""The pool a sharded job runs on: worker processes here (`ptq.parallel.workers.LocalPool`) or a Ray cluster
(`ptq.parallel.ray_backend.RayPool`)."""
from __future__ import annotations

from typing import Optional, Union

from ptq.parallel.ray_backend import RayPool
from ptq.parallel.workers import LocalPool, ShardJob


def make_runner(job: ShardJob, workers: int, ray: Optional[str] = None) -> Union[LocalPool, RayPool]:
    """A `LocalPool`, or with `ray` ('auto', an address, or 'local' for a cluster in this process) a
    `RayPool`; both are context managers."""
    if ray is not None:
        return RayPool(job, ray)
    return LocalPool(job, workers)
