"""What travels between the ingress and the engine replicas (pickled by Ray): plain dataclasses.

A generation is one streaming call: the replica first sends `Served` (its name, before any token, so
the ingress can pin a session to it), then the engine's `RequestOutput`s, and a request the engine
refused or failed ends with `Failed` instead of an exception, so the ingress re-raises radixserve's
own error with its own message (a Ray-wrapped exception would carry the replica's traceback).

Generations carry their cache namespace (`namespace`) for the router, which matches prefixes within
it only. Calls that must run on one named replica (pins, the tree view: replica_calls.py) start with
a `Target`; the router sends them there, and a replica that gets one meant for another (the target
was gone when it was routed) answers `NotHere`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.engine.beam_search import BeamSearchParams
from radixserve.engine.intake import ValidatedRequest
from radixserve.errors import EngineStoppedError, RequestError, RequestFailedError


@dataclass(frozen=True)
class EngineCall:
    request: ValidatedRequest  # checked by the ingress (engine/intake.py)
    request_id: str
    prefer: str | None = None  # the replica the request's session lives on, if any

    @property
    def prompt(self) -> list[int]:
        """What the router matches against its views of the replicas' caches, as for a BeamCall."""
        return self.request.token_ids

    @property
    def namespace(self) -> str:
        """The cache namespace the prompt is matched in."""
        return self.request.params.cache_namespace


@dataclass(frozen=True)
class BeamCall:
    prompt: list[int]
    params: BeamSearchParams
    priority: int = 0
    prefer: str | None = None

    @property
    def namespace(self) -> str:
        return self.params.cache_namespace


@dataclass(frozen=True)
class Target:
    """The first argument of a call that must run on `replica` (router.py routes it nowhere else)."""

    replica: str


@dataclass(frozen=True)
class NotHere:
    """A replica's answer to a call that targeted another one (which was gone when it was routed)."""

    replica: str


@dataclass(frozen=True)
class Served:
    replica: str
    events_seq: int = 0  # the replica's newest cache event when it took the request (routing.py: `recent`)


@dataclass(frozen=True)
class ReplicaFacts:
    replica: str
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    tokenizer: Any  # a transformers tokenizer (picklable) or None
    open_json_objects: bool = False  # the replicas' EngineConfig.open_json_objects: the ingress compiles alike


@dataclass(frozen=True)
class Failed:
    kind: str  # "request" (refused: 400), "stopped" (503) or "failed" (500)
    message: str
    code: str = RequestError.code

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        if isinstance(exc, RequestError):
            return cls("request", str(exc), exc.code)
        if isinstance(exc, EngineStoppedError):
            return cls("stopped", str(exc))
        if isinstance(exc, RequestFailedError):
            return cls("failed", str(exc))
        return cls("failed", "the replica failed this request; see its log")

    def error(self) -> Exception:
        if self.kind == "request":
            err = RequestError(self.message)
            err.code = self.code
            return err
        if self.kind == "stopped":
            return EngineStoppedError(self.message)
        return RequestFailedError(self.message)
