"""The continuous batcher: the only writer of a sequence, of a request's scheduling fields and of the
cache state (admission, chunk completion, forks, token commits, preemption, finish, pinned prefixes)."""

from radixserve.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
