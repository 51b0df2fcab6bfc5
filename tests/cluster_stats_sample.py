"""What GET /v1/cache/stats adds at the ingress of `serve --replicas 2`, as sample data: the web UI's
tests show it in the dashboard, and the cluster tests check the real reply has exactly this shape,
so the two cannot drift apart."""

from __future__ import annotations

from typing import Any


def replica(name: str, *, hit_rate: float, prompt: int, cached: int, requests: int, blocks: dict[str, int],
            running: int, waiting: int, routed: int, in_flight: int, view: tuple[int, int, int],
            prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """One entry of `replicas` in GET /v1/cache/stats (radixserve/scaleout/views.py::cluster_json)."""
    return {"replica": name, "hit_rate": hit_rate, "prompt_tokens": prompt, "cached_tokens": cached,
            "requests": requests, "blocks": blocks, "running": running, "waiting": waiting, "routed": routed,
            "in_flight": in_flight, "router_view": dict(zip(("prefixes", "tokens", "resyncs"), view, strict=True)),
            "system_prompts": prompts}


def prompt_row(sp_id: str, preview: str, requests: int, hits: int, hit_rate: float) -> dict[str, Any]:
    return {"id": sp_id, "preview": preview, "requests": requests, "hit_requests": hits,
            "cached_tokens": 100 * hits, "computed_tokens": 50 * requests, "hit_rate": hit_rate}


# Two replicas and the router as the ingress of `serve --replicas 2` reports them, every figure distinct.
TWO_REPLICAS = {
    "replicas": [
        replica("px365mzo", hit_rate=0.71, prompt=552, cached=393, requests=4,
                blocks={"total": 64, "free": 52, "used": 0, "cached": 12}, running=0, waiting=0, routed=4,
                in_flight=0, view=(4, 159, 0),
                prompts=[prompt_row("963aabc28416", "You are a helpful assistant.", 4, 3, 0.75)]),
        replica("q8k2ztw1", hit_rate=0.125, prompt=1600, cached=200, requests=9,
                blocks={"total": 64, "free": 16, "used": 32, "cached": 16}, running=2, waiting=3, routed=11,
                in_flight=5, view=(7, 2048, 1),
                prompts=[prompt_row("aa01", "Rarely used prompt", 1, 0, 0.0),
                         prompt_row("bb02", "You are a pirate.", 6, 5, 0.8),
                         prompt_row("cc03", "You are a poet.", 2, 1, 0.5)]),
    ],
    "routing": {"router": "cache-aware",
                "decisions": {"session": 2, "prefix": 5, "imbalance": 1, "miss": 3, "failover": 7, "fallback": 4}},
}



def shape(value: Any) -> Any:
    """The keys and value kinds of a JSON value; a list by the shape of its first item."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__
