"""The continuous batcher: the single owner of every cache state transition (admission, chunk
completion, forks, preemption, finish)."""

from radixserve.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
