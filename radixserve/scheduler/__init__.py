"""The continuous batcher: the only writer of a sequence and of the cache state (admission, chunk
completion, forks, token commits, preemption, finish)."""

from radixserve.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
