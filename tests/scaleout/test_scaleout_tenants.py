"""Scale-out with tenants: the router matches prefixes per cache namespace, sessions are per namespace,
and pins and the tree view span every replica.

First without Ray: the cluster's pins (cluster_pins.py) over fake replicas, and the merged tree view
(tree_merge.py). Then a local Ray cluster (started and stopped here, as in test_scaleout_cluster) of
2 replicas of the tiny random-weight model behind Ray Serve's proxy with two tenants' API keys:
tenant A's cached prefix on one replica does not attract tenant B's identical request (B is placed
by load, a `miss`, and hits nothing), while A's repeat follows A's prefix and hits; and a
ClusterEngine driven directly (SamplingParams.cache_namespace) shows sessions per namespace, a pin
made on both replicas that a request hits wherever it lands, and the merged tree view.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.cache.events import CacheEventLog
from radixserve.cache.tree_view import TreeNodeView, TreeView
from radixserve.engine.pins import PinBudget, PinError, PinInfo
from radixserve.engine.stats import EngineStats
from radixserve.errors import EngineStoppedError
from radixserve.scaleout.calls import Failed
from radixserve.scaleout.cluster_pins import ClusterPins
from radixserve.scaleout.routing import RoutingTable
from radixserve.scaleout.tree_merge import merge_views

pytest_plugins = ["server_testkit"]
from server_testkit import leaves_no_process, wait_until, write_tiny_chat_model  # noqa: E402

GONE = object()


class FakeReplicas:
    """Replicas as ClusterPins calls them: each pins under its own ids; `refuse` answers a pin with a
    refusal; `hold` (an event) keeps pins on that replica waiting until it is set."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.pins: dict[str, dict[str, PinInfo]] = {n: {} for n in names}
        self.refuse: set[str] = set()
        self.hold: dict[str, asyncio.Event] = {}
        self.asked: list[tuple[str, str]] = []

    def replicas(self) -> list[str]:
        return list(self.names)

    async def on(self, replica: str, method: str, *args: Any) -> Any:
        self.asked.append((replica, method))
        if replica not in self.names:
            return GONE
        if method == "unpin":
            return self.pins[replica].pop(args[0], None)
        assert method == "pin"
        if replica in self.hold:
            await self.hold[replica].wait()
        if replica in self.refuse:
            return Failed("request", f"pinning needs 9 blocks but only 1 of {replica}'s budget is left")
        tokens, namespace, label = args
        mine = self.pins.setdefault(replica, {})
        info = PinInfo(f"pin-{len(mine) + 7}", namespace, len(tokens), 2, 0, 0, 0.0, label)
        mine[info.id] = info
        return info


def pins_over(names: list[str]) -> tuple[ClusterPins, FakeReplicas, RoutingTable]:
    table = RoutingTable()
    table.set_replicas(names)
    fake = FakeReplicas(names)
    return ClusterPins(fake, table), fake, table


def test_a_pin_is_made_on_every_replica_under_one_id() -> None:
    async def run() -> None:
        pins, fake, table = pins_over(["a", "b"])
        info = await pins.pin([1, 2, 3], "t1", "support")
        assert (info.id, info.namespace, info.tokens, info.label, info.blocks) == ("pin-1", "t1", 3, "support", 2)
        assert [len(fake.pins[r]) for r in "ab"] == [1, 1]
        assert [p.id for p in pins.list()] == ["pin-1"]
        # hit counts come from the replicas' reports, summed (a request hits on one replica)
        for r, hits in (("a", 3), ("b", 4)):
            (mine,) = fake.pins[r].values()
            table.report(r, EngineStats(), CacheEventLog().since(0),
                         (PinInfo(mine.id, "t1", 3, 2, hits, 3 * hits, 0.0, "support"),), PinBudget(2 + hits, 10))
        (listed,) = pins.list()
        assert (listed.hits, listed.hit_tokens) == (7, 21)
        assert pins.budget() == PinBudget(6, 10)  # the tightest replica's: b has 4 blocks left, a 5
        gone = await pins.unpin("pin-1")
        assert gone is not None and gone.hits == 7
        assert fake.pins == {"a": {}, "b": {}} and pins.list() == []
        assert await pins.unpin("pin-1") is None

    asyncio.run(run())


def test_a_pin_one_replica_refuses_is_undone_on_the_others() -> None:
    async def run() -> None:
        pins, fake, _ = pins_over(["a", "b"])
        fake.refuse.add("b")
        with pytest.raises(PinError, match="only 1 of b's budget is left"):
            await pins.pin([1, 2, 3], "t1", "x")
        assert fake.pins == {"a": {}, "b": {}} and pins.list() == []
        empty, _, _ = pins_over([])
        with pytest.raises(EngineStoppedError):
            await empty.pin([1], "", "")
        assert empty.budget() == PinBudget(0, 0)

    asyncio.run(run())


def test_replicas_that_come_later_get_every_pin() -> None:
    async def run() -> None:
        pins, fake, _ = pins_over(["a", "b"])
        await pins.pin([1, 2], "t1", "x")
        fake.names = ["b", "c", "d"]  # a died; c replaced it; d is new and refuses
        fake.refuse.add("d")
        await pins.reconcile()
        assert len(fake.pins["c"]) == 1 and not fake.pins.get("d")
        await pins.reconcile()  # d refused once: it is not asked again
        assert fake.asked.count(("d", "pin")) == 1 and fake.asked.count(("c", "pin")) == 1
        await pins.unpin("pin-1")
        assert not fake.pins["b"] and not fake.pins["c"]
        assert ("a", "unpin") not in fake.asked  # gone with its cache

    asyncio.run(run())


def test_a_pin_unpinned_while_a_new_replica_was_given_it_is_unpinned_there() -> None:
    async def run() -> None:
        pins, fake, _ = pins_over(["a"])
        await pins.pin([1, 2], "t1", "x")
        fake.names = ["a", "c"]
        fake.hold["c"] = asyncio.Event()
        keeping = asyncio.ensure_future(pins.reconcile())
        await asyncio.sleep(0.01)
        await pins.unpin("pin-1")
        fake.hold["c"].set()
        await keeping
        assert fake.pins["a"] == {} and fake.pins["c"] == {}

    asyncio.run(run())


def node(id: int, parent: int | None, ns: str, tokens: int, subtree: int, pinned: bool = False) -> TreeNodeView:
    return TreeNodeView(id, parent, ns, 0, tokens, subtree, 0, (1, 2), "device", pinned, False, 1, id)


def test_the_tree_views_of_the_replicas_merge_into_one_bounded_view() -> None:
    a = TreeView([node(1, None, "t1", 10, 30, pinned=True), node(2, 1, "t1", 20, 20)], 2, 30, {"t1": 30})
    b = TreeView([node(1, None, "t1", 10, 15, pinned=True), node(3, 1, "t1", 5, 5), node(4, None, "t2", 8, 8)],
                 3, 23, {"t1": 15, "t2": 8})
    merged = merge_views({"b": b, "a": a}, limit=10)
    assert sorted(n.id for n in merged.nodes) == [2, 3, 4, 7, 9]  # id * 2 + (0 for a, 1 for b)
    assert (merged.total_nodes, merged.total_tokens, merged.namespaces) == (5, 53, {"t1": 45, "t2": 8})
    assert sum(n.pinned for n in merged.nodes) == 2  # the prefix pinned on each replica: two nodes
    top = merge_views({"a": a, "b": b}, limit=3)  # the largest subtrees first, and every parent shown
    ids = {n.id for n in top.nodes}
    assert ids == {2, 4, 3} and all(n.parent is None or n.parent in ids for n in top.nodes)
    by_id = {n.id: n for n in top.nodes}
    assert by_id[3].hidden_tokens == 5 and by_id[2].hidden_tokens == 0  # b's child of 5 tokens left out
    assert merge_views({}, 5) == TreeView()


# -- a Ray cluster with two tenants ------------------------------------------------------------------

KEYS = "key-a a user\nkey-b b user\nkey-ops ops admin\n"
SYSTEM = "You are the internal assistant of a shipping company. Answer in one short sentence. " * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ray.serve")
    from radixserve import EngineConfig
    from radixserve.model.embedded import embedded_model_dir
    from radixserve.scaleout.config import ClusterConfig
    from radixserve.scaleout.local import ServeCluster
    from radixserve.server import ServerConfig
    from radixserve.server.tenants import parse_api_keys

    model = str(write_tiny_chat_model(tmp_path_factory.mktemp("tiny-tenants"), embedded_model_dir(), 1024))
    server = ServerConfig(port=0, web_dir=None, shutdown_grace_s=1.0, served_model_name="tiny",
                          api_keys=parse_api_keys(KEYS))
    spec = ClusterConfig(replicas=2, torch_threads=1, stats_period_s=0.25, health_check_period_s=1.0)
    with leaves_no_process() as started, ServeCluster(EngineConfig(model=model, num_blocks=256), server, spec,
                                                      num_cpus=2, startup_timeout_s=300) as c:
        assert started(), "the cluster started no process of its own"
        yield c
        started()


def chat(url: str, key: str, user: str) -> httpx.Response:
    body = {"model": "tiny", "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r


def decisions(url: str) -> dict[str, int]:
    r = httpx.get(url + "/v1/cache/stats", headers={"Authorization": "Bearer key-ops"}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json()["routing"]["decisions"])


def test_a_tenants_prefix_does_not_attract_another_tenants_request(cluster: Any) -> None:
    from radixserve.server.replica_header import HEADER

    before = decisions(cluster.url)
    first_a = chat(cluster.url, "key-a", "Where is my parcel?")
    first_b = chat(cluster.url, "key-b", "Where is my parcel?")  # the very same prompt
    again_a = chat(cluster.url, "key-a", "Where is my parcel?")
    again_b = chat(cluster.url, "key-b", "Where is my parcel?")
    home_a, home_b = first_a.headers[HEADER], first_b.headers[HEADER]
    # both replicas idle: B's miss goes to the one whose picture holds fewer tokens, not A's
    assert home_b != home_a
    assert (again_a.headers[HEADER], again_b.headers[HEADER]) == (home_a, home_b)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first_a, first_b, again_a, again_b)]
    prompt = first_a.json()["usage"]["prompt_tokens"]
    assert cached[:2] == [0, 0] and min(cached[2:]) >= prompt - 16, cached  # each repeat hits its own prefix
    after = decisions(cluster.url)
    assert after["miss"] - before["miss"] == 2 and after["prefix"] - before["prefix"] == 2, (before, after)


def test_the_cluster_engine_keeps_sessions_pins_and_the_tree_per_namespace(cluster: Any) -> None:
    from ray import serve

    from radixserve.core import Placement
    from radixserve.sampling_params import SamplingParams
    from radixserve.scaleout.cluster_engine import ClusterEngine
    from radixserve.scaleout.config import ENGINE_DEPLOYMENT

    app = cluster.cluster.app_name
    prompt = [(7 * i) % 500 + 10 for i in range(96)]

    async def generate(engine: ClusterEngine, tokens: list[int], namespace: str,
                       placement: Placement | None = None) -> tuple[str, int]:
        last = None
        params = SamplingParams(max_tokens=2, temperature=0.0, cache_namespace=namespace)
        async for out in engine.generate(tokens, params, placement=placement or Placement()):
            last = out
        assert last is not None and last.finished
        return (placement.replica if placement is not None else ""), last.usage.cached_tokens

    async def run() -> None:
        engine = ClusterEngine(serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app), f"{app}/{ENGINE_DEPLOYMENT}")
        await engine.start()
        try:
            replicas = engine.calls.replicas()
            assert len(replicas) == 2
            # a session of namespace x lives on one replica; y's request naming the same session id is
            # routed by the rule (its own prefix elsewhere), never by x's session
            home, _ = await generate(engine, prompt, "x", Placement(affinity="s1"))
            elsewhere, cached = await generate(engine, [5] * 40 + prompt, "y", Placement(affinity="s1"))
            assert cached == 0 and engine.table.decisions["session"] == 0
            assert elsewhere != home  # a miss: the emptier replica
            again, _ = await generate(engine, prompt, "x", Placement(affinity="s1"))
            assert again == home and engine.table.decisions["session"] == 1

            # a pin of namespace z on both replicas: a request hits it wherever it lands
            system = [(11 * i) % 400 + 20 for i in range(64)]
            info = await engine.pin(system, "z", "z's system prompt")
            assert (info.namespace, info.tokens) == ("z", 64)
            assert [p.id for p in engine.pins()] == [info.id]
            wait_until(lambda: all(len(rep.pins) == 1 for rep in engine.table.reports.values()), 30,
                       "both replicas to report the pin")
            budget = engine.pin_budget()
            assert budget.used_blocks >= 4 and budget.budget_blocks > budget.used_blocks
            for r in replicas:
                engine.table.loads[r] += 100  # steer the next two requests: each replica once
                where, cached = await generate(engine, system + [1, 2, 3], "z")
                engine.table.loads[r] -= 100
                assert where != r and cached == 64, (where, cached)

            view = await engine.cache_tree(100)
            pinned = [n for n in view.nodes if n.pinned]
            assert {n.namespace for n in pinned} == {"z"} and len({n.id for n in pinned}) >= 2
            assert set(view.namespaces) >= {"x", "y", "z"}
            only_y = await engine.cache_tree(100, lambda ns: ns == "y")
            assert {n.namespace for n in only_y.nodes} == {"y"} and set(only_y.namespaces) == {"y"}

            assert (await engine.unpin(info.id)) is not None and engine.pins() == []
            wait_until(lambda: all(not rep.pins for rep in engine.table.reports.values()), 30,
                       "both replicas to report the pin gone")
            assert not any(n.pinned for n in (await engine.cache_tree(100)).nodes)
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_an_admins_pin_is_made_on_every_replica_for_its_tenant_only(cluster: Any) -> None:
    pinned = "You answer questions about customs forms for tenant b, in one sentence. " * 3
    admin = {"Authorization": "Bearer key-ops"}
    url = cluster.url
    body = {"system": pinned, "tenant": "b"}
    assert httpx.post(url + "/v1/cache/pins", json=body, headers={"Authorization": "Bearer key-b"},
                      timeout=60).status_code == 403
    r = httpx.post(url + "/v1/cache/pins", json=body, headers=admin, timeout=120)
    assert r.status_code == 201, r.text
    pin = r.json()
    assert pin["tenant"] == "b" and pin["tokens"] > 32

    def ask(key: str) -> int:
        msgs = [{"role": "system", "content": pinned}, {"role": "user", "content": "Which form?"}]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": msgs},
                       headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert ask("key-b") >= pin["tokens"] - 16  # b's own pin
    assert ask("key-a") < 16  # at most the chat template's opening, which a's own chats cached: not b's pin
    tree = httpx.get(url + "/v1/cache/tree?limit=500", headers=admin, timeout=60).json()
    tops = [n for n in tree["nodes"] if n["pinned"] and n["tenant"] == "b" and n["parent"] is None]
    assert len(tops) == 2, tops  # the pinned prefix on each replica
    mine = httpx.get(url + "/v1/cache/tree?limit=500", headers={"Authorization": "Bearer key-a"}, timeout=60).json()
    assert mine["nodes"] and {n["tenant"] for n in mine["nodes"]} == {"a"}
    assert httpx.delete(url + f"/v1/cache/pins/{pin['id']}", headers=admin, timeout=60).status_code == 200
    assert httpx.get(url + "/v1/cache/pins", headers=admin, timeout=60).json()["data"] == []
