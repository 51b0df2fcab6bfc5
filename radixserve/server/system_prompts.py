"""Per-system-prompt counters: the rows of the /v1/cache/stats table and bounded label sets for
Prometheus, one tracker per tenant (tenant_stats.py) and per engine replica (scaleout/).

System prompts are keyed by a hash of their token IDs; `SystemPromptTracker` keeps exact per-prompt
counters for the JSON table and bounded, monotonic label sets for Prometheus: a prompt gets its own
label value on its first request while fewer than `labels` prompts have one, and keeps it (labels
are never taken back, so its first request counts under its label too); every other request counts
under "other", requests without a system prompt under "none". A request "hit" when its cached
tokens cover its whole system prompt (for "none": the template's own preamble, e.g. SmolLM2's
default system prompt).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

NONE_KEY, OTHER_KEY = "none", "other"
MAX_TRACKED = 4096  # exact per-prompt rows kept for the JSON table


@dataclass
class PromptCounts:
    requests: int = 0
    hit_requests: int = 0  # the whole system prompt came from the cache
    cached_tokens: int = 0
    computed_tokens: int = 0

    def add(self, hit: bool, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests += 1
        self.hit_requests += int(hit)
        self.cached_tokens += cached_tokens
        self.computed_tokens += prompt_tokens - cached_tokens

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_requests / self.requests if self.requests else 0.0}


class SystemPromptTracker:
    def __init__(self, labels: int, max_tracked: int = MAX_TRACKED) -> None:
        self.labels, self.max_tracked = labels, max_tracked
        self.exact: dict[str, PromptCounts] = {}
        self.previews: dict[str, str] = {NONE_KEY: "(no system prompt)", OTHER_KEY: "(other system prompts)"}
        self.labelled: dict[str, PromptCounts] = {NONE_KEY: PromptCounts(), OTHER_KEY: PromptCounts()}
        self.total = PromptCounts()
        self.untracked = PromptCounts()  # exact rows dropped to stay within max_tracked

    def record(self, key: str, preview: str, system_len: int, prompt_tokens: int, cached_tokens: int) -> None:
        hit = cached_tokens >= system_len > 0
        self.total.add(hit, prompt_tokens, cached_tokens)
        if key not in self.exact and len(self.exact) >= self.max_tracked:
            self._drop_smallest()
        row = self.exact.setdefault(key, PromptCounts())
        row.add(hit, prompt_tokens, cached_tokens)
        self.previews.setdefault(key, preview)
        label = self._label_for(key)
        self.labelled.setdefault(label, PromptCounts()).add(hit, prompt_tokens, cached_tokens)

    def _label_for(self, key: str) -> str:
        # A label is decided on a prompt's first request, so that request counts under it too: moving
        # it out of "other" later would make "other" go down, which a Prometheus counter must not.
        if key in self.labelled or len(self.labelled) - 2 < self.labels:
            return key
        return OTHER_KEY

    def _drop_smallest(self) -> None:
        victim = min((k for k in self.exact if k not in self.labelled), key=lambda k: self.exact[k].requests,
                     default=None)
        if victim is not None:
            c = self.exact.pop(victim)
            self.previews.pop(victim, None)
            for f in ("requests", "hit_requests", "cached_tokens", "computed_tokens"):
                setattr(self.untracked, f, getattr(self.untracked, f) + getattr(c, f))

    def table(self, top: int) -> list[dict[str, Any]]:
        """The `top` busiest system prompts by request count, then "other" for the rest."""
        ranked = sorted(self.exact.items(), key=lambda kv: kv[1].requests, reverse=True)
        shown, rest = ranked[:top], PromptCounts(**asdict(self.untracked))
        for _, c in ranked[top:]:
            for f in ("requests", "hit_requests", "cached_tokens", "computed_tokens"):
                setattr(rest, f, getattr(rest, f) + getattr(c, f))
        rows = [{"id": k, "preview": self.previews.get(k, ""), **c.to_json()} for k, c in shown]
        if rest.requests:
            rows.append({"id": OTHER_KEY, "preview": self.previews[OTHER_KEY], **rest.to_json()})
        return rows


def hide_previews(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System-prompt rows without their prompts' text (the placeholders of "none" and "other" stay)."""
    return [r if r.get("id") in (NONE_KEY, OTHER_KEY) else {**r, "preview": ""} for r in rows]
