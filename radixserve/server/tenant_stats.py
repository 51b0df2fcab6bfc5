"""Cache figures per tenant: each tenant's request, token and hit counts and its own system-prompt
table (metrics.SystemPromptTracker), and the Prometheus families that show them.

Recorded once per finished request on the event loop (generation.record_system_prompt), keyed by the
tenant of the caller that sent it. Who sees what is decided by the reader: `TenantCollector(only=t)`
yields only tenant t's series and `table(top, only=t)` only its prompts; previews (system-prompt
text) only when the caller may see them (callers.sees_previews; system_prompts.hide_previews).

Invariants: tenants come only from callers, whose tenants come only from the configured keys (or
DEFAULT_TENANT), so the `tenant` label's values are bounded by the keys file; each tenant's
`system_prompt` label values are bounded by --system-prompt-labels, as they were server-wide
(metrics.SystemPromptTracker). Counters only go up.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.core import Usage
from radixserve.server.system_prompts import NONE_KEY, OTHER_KEY, PromptCounts, SystemPromptTracker

OTHER_PREVIEW = "(other system prompts)"


@dataclass
class TenantUsage:
    requests: int = 0
    hit_requests: int = 0  # requests that found any of their prompt in the cache
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # the part of cached_tokens loaded back from the host tier
    computed_tokens: int = 0
    generation_tokens: int = 0

    def add(self, u: Usage) -> None:
        self.requests += 1
        self.hit_requests += int(u.cached_tokens > 0)
        self.prompt_tokens += u.prompt_tokens
        self.cached_tokens += u.cached_tokens
        self.host_cached_tokens += u.host_cached_tokens
        self.computed_tokens += u.prompt_tokens - u.cached_tokens
        self.generation_tokens += u.completion_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self, tenant: str) -> dict[str, Any]:
        return {"tenant": tenant, "requests": self.requests, "hit_requests": self.hit_requests,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "host_cached_tokens": self.host_cached_tokens, "computed_tokens": self.computed_tokens,
                "generation_tokens": self.generation_tokens, "hit_rate": self.hit_rate,
                "request_hit_rate": self.hit_requests / self.requests if self.requests else 0.0}


class TenantStats:
    def __init__(self, labels: int) -> None:
        self.labels = labels  # system-prompt label values per tenant
        self.usage: dict[str, TenantUsage] = {}
        self.prompts: dict[str, SystemPromptTracker] = {}

    def record(self, tenant: str, key: str, preview: str, system_len: int, usage: Usage) -> None:
        self.usage_of(tenant).add(usage)
        self.prompts_of(tenant).record(key, preview, system_len, usage.prompt_tokens, usage.cached_tokens)

    def usage_of(self, tenant: str) -> TenantUsage:
        return self.usage.setdefault(tenant, TenantUsage())

    def prompts_of(self, tenant: str) -> SystemPromptTracker:
        tracker = self.prompts.get(tenant)
        if tracker is None:
            tracker = self.prompts[tenant] = SystemPromptTracker(self.labels)
        return tracker

    def tenants(self, only: str | None = None) -> list[str]:
        """The tenants a reader sees: every one that sent a request, or just `only` (even before its first)."""
        return [only] if only is not None else sorted(self.usage)

    def summary(self, only: str | None = None) -> list[dict[str, Any]]:
        return [self.usage_of(t).to_json(t) for t in self.tenants(only)]

    def table(self, top: int, only: str | None = None) -> list[dict[str, Any]]:
        """The `top` busiest system prompts of the tenants a reader sees, each row naming its tenant,
        then one "other" row per tenant with the rest of its requests."""
        named: list[dict[str, Any]] = []
        other: dict[str, PromptCounts] = {}
        for t in self.tenants(only):
            for row in self.prompts_of(t).table(top):
                if row["id"] == OTHER_KEY:
                    _fold(other.setdefault(t, PromptCounts()), row)
                else:
                    named.append({"tenant": t, **row})
        named.sort(key=lambda r: -r["requests"])
        for row in named[top:]:  # past the top across tenants: into its tenant's "other"
            _fold(other.setdefault(row["tenant"], PromptCounts()), row)
        rest = [{"tenant": t, "id": OTHER_KEY, "preview": OTHER_PREVIEW, **c.to_json()}
                for t, c in sorted(other.items())]
        return named[:top] + rest


def _fold(into: PromptCounts, row: dict[str, Any]) -> None:
    for f in ("requests", "hit_requests", "cached_tokens", "computed_tokens"):
        setattr(into, f, getattr(into, f) + row[f])


class TenantCollector(Collector):
    """`radixserve_tenant_*{tenant}` and `radixserve_system_prompt_*{tenant,system_prompt}`: every
    tenant's series, or only tenant `only`'s. Made per scrape: what it shows depends on the caller."""

    USAGE = (("requests", "requests", "Requests finished, per tenant"),
             ("cache_hit_requests", "hit_requests", "Requests that found part of their prompt in the cache, per tenant"),
             ("prompt_tokens", "prompt_tokens", "Prompt tokens, per tenant"),
             ("prompt_tokens_cached", "cached_tokens", "Prompt tokens served from the prefix cache, per tenant"),
             ("prompt_tokens_host_cached", "host_cached_tokens",
              "Cached prompt tokens loaded back from the host tier, per tenant"),
             ("prompt_tokens_computed", "computed_tokens", "Prompt tokens computed (prefilled), per tenant"),
             ("generation_tokens", "generation_tokens", "Generated tokens, per tenant"))  # metric, TenantUsage field, help
    PROMPTS = (("requests", "Requests per system prompt"),
               ("hit_requests", "Requests whose whole system prompt was cached"),
               ("cached_tokens", "Cached prompt tokens of requests per system prompt"),
               ("computed_tokens", "Computed prompt tokens of requests per system prompt"))

    def __init__(self, stats: TenantStats, only: str | None = None, previews: bool = True) -> None:
        self.stats, self.only, self.previews = stats, only, previews

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        tenants = self.stats.tenants(self.only)
        for name, field, doc in self.USAGE:
            fam = CounterMetricFamily(f"radixserve_tenant_{name}", doc, labels=["tenant"])
            for t in tenants:
                fam.add_metric([t], getattr(self.stats.usage_of(t), field))
            yield fam
        fams = {field: CounterMetricFamily(f"radixserve_system_prompt_{field}", doc, labels=["tenant", "system_prompt"])
                for field, doc in self.PROMPTS}
        info = InfoMetricFamily("radixserve_system_prompt", "Preview of each labelled system prompt (empty unless "
                                "the caller may see previews)", labels=["tenant", "system_prompt"])
        for t in tenants:
            tracker = self.stats.prompts_of(t)
            for key, counts in list(tracker.labelled.items()):
                for field, fam in fams.items():
                    fam.add_metric([t, key], getattr(counts, field))
                shown = self.previews or key in (NONE_KEY, OTHER_KEY)  # placeholders, not prompts
                preview = tracker.previews.get(key, "")[:60] if shown else ""
                info.add_metric([t, key], {"preview": preview})
        yield from fams.values()
        yield info
