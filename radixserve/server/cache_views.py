"""GET /v1/cache/stats and GET /metrics as each caller may see them (docs/tenants.md).

An admin sees everything: the engine's figures, every tenant's (`tenants`), every tenant's system
prompts and, over replicas, the cluster's. A `user` key sees only its own tenant: its figures where
the engine's totals stand and 0 for what reflects other tenants' traffic (cache_stats.tenant_cache_stats_json),
its own system prompts; on /metrics only its tenant's series and the pool's capacity. Prompt text
(previews) is shown to a caller with a key (its own tenant's, or every tenant's to an admin), and on
an open server only with --show-prompt-previews (loopback only: ServerConfig).

Both answer from what is already published (the engine's last snapshot, the counters kept on the
event loop): they never wait for an engine step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.server.cache_stats import cache_stats_json, tenant_cache_stats_json
from radixserve.server.callers import caller_of, sees_previews
from radixserve.server.state import ServerState
from radixserve.server.system_prompts import hide_previews
from radixserve.server.tenant_stats import TenantCollector

SYSTEM_PROMPT_ROWS = 20  # rows of the /v1/cache/stats table


async def cache_stats(request: Request) -> Response:
    state: ServerState = request.app.state.server
    caller = caller_of(request)
    engine = state.require_engine()
    st = state.engine_stats()  # the last published snapshot: answers at once, never waits for a step
    assert st is not None  # the engine is there (require_engine)
    state.observe_steps()
    tenants, store = state.metrics.tenants, state.sessions
    previews = sees_previews(caller, state.config)
    only = None if caller.is_admin else caller.tenant
    rows = tenants.table(SYSTEM_PROMPT_ROWS, only)
    rows = rows if previews else hide_previews(rows)
    if only is None:
        body = cache_stats_json(st, engine.block_size, len(store) if store is not None else 0, rows,
                                state.metrics.step_utilization.to_json())
        if state.extra_cache_stats is not None:  # the cluster's replicas and routing (scaleout/)
            body.update(await asyncio.to_thread(state.extra_cache_stats))
            if not previews:
                for replica in body.get("replicas", ()):
                    replica["system_prompts"] = hide_previews(replica.get("system_prompts", []))
    else:
        sessions = store.count(only) if store is not None else 0
        body = tenant_cache_stats_json(st, engine.block_size, tenants.usage_of(only), sessions, rows)
    body.update(scope="all" if only is None else "tenant", tenant=caller.tenant, role=caller.role.value,
                tenants=tenants.summary(only))
    return JSONResponse(body)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    caller = caller_of(request)
    # on the event loop, a few ms: the engine's figures are its last published snapshot and its steps
    # what it recorded (never waits for a step), and no worker thread is needed that a busy thread
    # pool could hold up
    state.observe_steps()
    previews = sees_previews(caller, state.config)
    scrape: list[Collector]
    if caller.is_admin:
        scrape = [state.metrics.registry, TenantCollector(state.metrics.tenants, None, previews)]
    else:
        scrape = [TenantCollector(state.metrics.tenants, caller.tenant, previews), _Capacity(state)]
    return Response(generate_latest(_Scrape(scrape)), media_type=CONTENT_TYPE_LATEST)


class _Scrape(Collector):
    """One scrape's collectors, in order."""

    def __init__(self, parts: list[Collector]) -> None:
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        for part in self.parts:
            yield from part.collect()


class _Capacity(Collector):
    """The pool's size, the one engine-wide figure a `user` key's scrape shows (it says nothing of traffic)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        st: Any = self.state.engine_stats()
        if st is not None:
            yield GaugeMetricFamily("radixserve_kv_blocks_total", "KV blocks in the pool", value=st.blocks_total)
