"""GET /v1/cache/tree?limit=N: a bounded picture of the radix tree for the dashboard's tree view —
the `limit` nodes holding the most tokens (the most recently used first on a tie), connected, each with
its tier (device / host / both), whether it is pinned or locked, its hits, and a label: its first
words, decoded from its first token ids.

Who sees what: an admin sees every namespace; a user key only its own tenant's (the others are not
in any figure of the reply: cache/tree_view.py). Labels are prompt text, so they are sent only to
callers who may see previews (callers.sees_previews); otherwise `label` is null and `labels` false.
Namespaces are named by their tenant; a salted one (a request's cache_salt) is marked `salted` and
given an opaque id, never the salt.

Invariants: 1 <= limit <= MAX_LIMIT (DEFAULT_LIMIT when absent); every node's `parent` is a node of
the reply or null (a child of its namespace's root); `namespace` is one of the reply's namespace ids.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.engine.client import TreeView
from radixserve.server.callers import caller_of, sees_previews
from radixserve.server.state import ServerState
from radixserve.server.tenants import is_salted, namespace_tenant
from radixserve.server.validation import ApiError

DEFAULT_LIMIT = 200
MAX_LIMIT = 2000
LABEL_CHARS = 48  # of a node's decoded first tokens


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError("invalid_field", f"'limit' must be an integer in [1, {MAX_LIMIT}], got {raw!r}", param="limit")
    return limit


def _labels(tokenizer: Any, heads: list[list[int]]) -> list[str]:
    """The first words of each head (a head may start or end inside a character: those bytes go)."""
    texts = tokenizer.batch_decode(heads, skip_special_tokens=True) if heads else []
    return [" ".join(str(t).replace("\ufffd", "").split())[:LABEL_CHARS] for t in texts]


def _namespace_ids(view: TreeView) -> dict[str, dict[str, Any]]:
    """Each namespace's entry of the reply; a salted one is numbered within its tenant, never named."""
    out: dict[str, dict[str, Any]] = {}
    salted: dict[str, int] = {}
    for ns in sorted(view.namespaces, key=lambda n: (namespace_tenant(n), is_salted(n), -view.namespaces[n])):
        tenant = namespace_tenant(ns)
        if is_salted(ns):
            salted[tenant] = salted.get(tenant, 0) + 1
            key = f"{tenant}/salted-{salted[tenant]}"
        else:
            key = tenant or "(shared)"
        out[ns] = {"id": key, "tenant": tenant or None, "salted": is_salted(ns), "tokens": view.namespaces[ns]}
    return out


async def cache_tree(request: Request) -> Response:
    state: ServerState = request.app.state.server
    caller = caller_of(request)
    limit = _limit(request.query_params.get("limit"))
    engine = state.require_engine()
    include = None if caller.is_admin else (lambda ns: namespace_tenant(ns) == caller.tenant)
    view = await engine.cache_tree(limit, include)
    namespaces = _namespace_ids(view)
    formatter = state.formatter if sees_previews(caller, state.config) else None  # no tokenizer: no labels
    heads = [list(n.head) for n in view.nodes]
    labels: list[str | None] = [*_labels(formatter.tokenizer, heads)] if formatter is not None else [None] * len(heads)
    nodes = [{
        "id": n.id, "parent": n.parent, "namespace": namespaces[n.namespace]["id"],
        "tenant": namespaces[n.namespace]["tenant"], "salted": namespaces[n.namespace]["salted"], "start": n.start,
        "tokens": n.tokens, "subtree_tokens": n.subtree_tokens, "hidden_tokens": n.hidden_tokens, "tier": n.tier,
        "pinned": n.pinned, "locked": n.locked, "hits": n.hits, "last_access": n.last_access, "label": label,
    } for n, label in zip(view.nodes, labels, strict=True)]
    return JSONResponse({
        "object": "cache.tree", "limit": limit, "labels": formatter is not None, "total_nodes": view.total_nodes,
        "total_tokens": view.total_tokens, "namespaces": list(namespaces.values()), "nodes": nodes,
    })


ROUTES = [Route("/v1/cache/tree", cache_tree, methods=["GET"])]
