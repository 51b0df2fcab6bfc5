"""Tenants against a real server (issue 29, items 1-3): keys from an --api-keys file, each tenant's
cache namespace, `cache_salt`, sessions and stored responses that never cross tenants, and the cache
figures each role sees. Two servers over the tiny chat model: one sharing the cache per tenant (the
default), one sharing it globally; the open shared `tiny_chat_server` for what an open server shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import AsyncEngine, EngineConfig
from radixserve.core import Usage
from radixserve.engine.stats import EngineStats
from radixserve.server import BackgroundServer, ServerConfig
from radixserve.server.cache_stats import cache_stats_json, tenant_cache_stats_json
from radixserve.server.cli import add_server_arguments, server_config_from_args
from radixserve.server.owners import OWNER_HEADER
from radixserve.server.tenant_stats import TenantUsage
from radixserve.server.tenants import load_api_keys

pytest.register_assert_rewrite("server_testkit")
from server_testkit import connect, recv_frame  # noqa: E402

pytest_plugins = ["server_testkit"]

ALPHA_ADMIN, ALPHA_USER, BETA_USER, ROOT = "alpha-admin-key", "alpha-user-key", "beta-user-key", "root-admin-key"
KEYS_FILE = f"""# tenants of the tests
{ALPHA_ADMIN} alpha admin
{ALPHA_USER}  alpha user   # a second key of the same tenant
{BETA_USER}   beta  user
{ROOT}        ops   admin
"""
SECRET = "tenant-tests-owner-secret-0123456789"  # one owner secret, sent by every tenant
TINY = {"temperature": 0, "max_tokens": 1}


def start(tmp: Path, sharing: str) -> BackgroundServer:
    from tiny_models import tiny_chat_model_dir

    keys = tmp / "keys.txt"
    keys.write_text(KEYS_FILE)
    config = ServerConfig(port=0, web_dir=None, shutdown_grace_s=0.5, api_keys=load_api_keys(keys),
                          cache_sharing=sharing)
    model = str(tiny_chat_model_dir("llama"))
    return BackgroundServer(lambda: AsyncEngine(EngineConfig(model=model, num_blocks=512)), config)


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with start(tmp_path_factory.mktemp("keys"), "tenant") as srv:
        yield srv


@pytest.fixture(scope="module")
def global_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with start(tmp_path_factory.mktemp("keys"), "global") as srv:
        yield srv


def client(srv: BackgroundServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def http(srv: BackgroundServer, key: str | None = None) -> httpx.Client:
    headers = {OWNER_HEADER: SECRET, **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.Client(base_url=srv.url, timeout=60, headers=headers)


# A miss: a namespace that has seen other prompts still matches the chat template's opening
# ("<|im_start|>system\n" and what the tokenizer merges into it), the same whether or not another
# tenant sent this prompt; a hit covers most of the prompt.
MISS = 12


def system_prompt(tag: str) -> str:
    """A system prompt long enough to fill several cache blocks, unique from its first characters on."""
    return f"{uuid.uuid4().hex} is the {tag} assistant. " + "Answer briefly and politely. " * 12


def chat_cached(srv: BackgroundServer, key: str, system: str, **extra: Any) -> int:
    """usage.prompt_tokens_details.cached_tokens of one chat completion, as the openai client reads it."""
    reply = client(srv, key).chat.completions.create(
        model=srv.state.model_name, messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        max_tokens=1, temperature=0, extra_body=extra or None)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


# -- keys and roles -------------------------------------------------------------------------------

def test_the_cli_reads_the_keys_file_and_refuses_previews_off_loopback(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(KEYS_FILE)
    p = argparse.ArgumentParser()
    add_server_arguments(p)
    config = server_config_from_args(p.parse_args(["--api-keys", str(keys), "--cache-sharing", "global"]))
    assert {(k.key, k.caller.tenant, k.caller.role.value) for k in config.api_keys} == {
        (ALPHA_ADMIN, "alpha", "admin"), (ALPHA_USER, "alpha", "user"), (BETA_USER, "beta", "user"),
        (ROOT, "ops", "admin")}
    assert config.cache_sharing == "global"
    keys.write_text("k1 alpha admin\nk2 beta superuser\n")
    with pytest.raises(ValueError, match="line 2: ROLE must be admin or user"):
        server_config_from_args(p.parse_args(["--api-keys", str(keys)]))
    assert server_config_from_args(p.parse_args(["--show-prompt-previews"])).show_prompt_previews
    with pytest.raises(ValueError, match="only accepted when the server binds a loopback address"):
        server_config_from_args(p.parse_args(["--show-prompt-previews", "--host", "0.0.0.0"]))
    with pytest.raises(SystemExit):  # argparse's choices
        p.parse_args(["--cache-sharing", "everyone"])


def test_an_unknown_key_is_refused_and_a_user_key_is_forbidden_admin_endpoints(tenant_server: BackgroundServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        chat_cached(tenant_server, "not-a-key", "Hello.")
    r = http(tenant_server, "wrong-key").post("/v1/sessions", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    r = http(tenant_server, BETA_USER).delete("/v1/cache/pins/no-such-pin")
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    assert r.json()["error"]["code"] == "forbidden"
    r = http(tenant_server, ALPHA_ADMIN).delete("/v1/cache/pins/no-such-pin")
    assert r.status_code == 404, r.text  # an admin gets past the role check to the pin's lookup
    assert http(tenant_server).get("/metrics").status_code == 401


# -- cache namespaces -------------------------------------------------------------------------------

def test_a_tenant_hits_only_what_its_own_tenant_cached(tenant_server: BackgroundServer) -> None:
    system = system_prompt("namespaces")
    assert chat_cached(tenant_server, ALPHA_USER, system) == 0
    hit = chat_cached(tenant_server, ALPHA_ADMIN, system)  # another key of the same tenant
    assert hit > 0
    assert chat_cached(tenant_server, BETA_USER, system) == 0  # the very prompt alpha just cached
    assert chat_cached(tenant_server, BETA_USER, system) == hit  # now beta's own
    assert chat_cached(tenant_server, ROOT, system) == 0  # an admin of another tenant does not hit either


def test_under_global_sharing_every_tenant_hits(global_server: BackgroundServer) -> None:
    system = system_prompt("global")
    assert chat_cached(global_server, ALPHA_USER, system) == 0
    assert chat_cached(global_server, BETA_USER, system) > 0
    assert chat_cached(global_server, BETA_USER, system, cache_salt="mine") == 0  # a salt still narrows it


def test_cache_salt_isolates_within_a_tenant(tenant_server: BackgroundServer) -> None:
    system = system_prompt("salt")
    assert chat_cached(tenant_server, ALPHA_USER, system, cache_salt="s1") == 0
    hit = chat_cached(tenant_server, ALPHA_USER, system, cache_salt="s1")
    assert hit > 0
    assert chat_cached(tenant_server, ALPHA_USER, system, cache_salt="s2") < MISS
    assert chat_cached(tenant_server, ALPHA_USER, system) < MISS  # no salt is a namespace of its own
    assert chat_cached(tenant_server, BETA_USER, system, cache_salt="s1") < MISS  # the same salt in another tenant


@pytest.mark.parametrize("salt", [123, "", "x" * 257, ["s"]])
def test_a_malformed_cache_salt_is_refused_on_every_api(tenant_server: BackgroundServer, salt: Any) -> None:
    srv, model = tenant_server, tenant_server.state.model_name
    c = client(srv, ALPHA_USER)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                  extra_body={"cache_salt": salt})
    assert e.value.body["param"] == "cache_salt" and "cache_salt must be a non-empty string" in e.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"cache_salt": salt})
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=model, input="Hi", max_output_tokens=1, extra_body={"cache_salt": salt})
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=srv.url, api_key=ALPHA_USER, max_retries=0).messages.create(
            model=model, max_tokens=1, messages=[{"role": "user", "content": "Hi"}], extra_body={"cache_salt": salt})
    h = http(srv, ALPHA_USER)
    r = h.post("/v1/sessions", json={"cache_salt": salt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
    sid = h.post("/v1/sessions", json={"sampling": TINY}).json()["id"]
    r = h.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi", "cache_salt": salt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_every_api_keeps_tenants_apart(tenant_server: BackgroundServer) -> None:
    """Completions, Responses and Messages (the Anthropic client sends its key as x-api-key) each hit
    only their own tenant's prefixes."""
    srv, model = tenant_server, tenant_server.state.model_name
    prompt = system_prompt("completions")

    def completion(key: str) -> int:
        u = client(srv, key).completions.create(model=model, prompt=prompt, max_tokens=1).usage
        return (u.prompt_tokens_details.cached_tokens or 0) if u and u.prompt_tokens_details else -1

    assert completion(ALPHA_USER) < MISS and completion(BETA_USER) < MISS and completion(ALPHA_ADMIN) > MISS

    instructions = system_prompt("responses")

    def response(key: str) -> int:
        u = client(srv, key).responses.create(model=model, instructions=instructions, input="Hi",
                                              max_output_tokens=1, store=False).usage
        assert u is not None
        return u.input_tokens_details.cached_tokens

    assert response(ALPHA_USER) < MISS and response(BETA_USER) < MISS and response(ALPHA_USER) > MISS

    system = system_prompt("messages")

    def message(key: str, **extra: Any) -> int:
        reply = anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0).messages.create(
            model=model, max_tokens=1, system=system, messages=[{"role": "user", "content": "Hi"}],
            extra_body=extra or None)
        return reply.usage.cache_read_input_tokens or 0

    assert message(BETA_USER) < MISS and message(ALPHA_USER) < MISS and message(BETA_USER) > MISS
    assert message(BETA_USER, cache_salt="other") == 0  # a namespace nothing was cached in

    beams = system_prompt("beams")  # a beam search's steps run in its caller's namespace
    reply = client(srv, ALPHA_USER).chat.completions.create(
        model=model, messages=[{"role": "system", "content": beams}, {"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=0, extra_body={"use_beam_search": True, "beam_width": 2, "cache_salt": "beam-salt"})
    assert reply.choices
    assert chat_cached(srv, BETA_USER, beams, cache_salt="beam-salt") < MISS
    assert chat_cached(srv, ALPHA_USER, beams) < MISS
    assert chat_cached(srv, ALPHA_USER, beams, cache_salt="beam-salt") > MISS


# -- sessions and stored responses ------------------------------------------------------------------

def test_sessions_of_one_tenant_are_unknown_to_another(tenant_server: BackgroundServer) -> None:
    a, b = http(tenant_server, ALPHA_USER), http(tenant_server, BETA_USER)
    created = a.post("/v1/sessions", json={"system_prompt": system_prompt("session"), "sampling": TINY,
                                           "cache_salt": "conversation-1"})
    assert created.status_code == 201, created.text
    sid = created.json()["id"]
    first = a.post(f"/v1/sessions/{sid}/messages", json={"content": "Hi"}).json()
    assert first["usage"]["cached_tokens"] == 0
    second = a.post(f"/v1/sessions/{sid}/messages", json={"content": "Again"}).json()
    assert second["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16  # the salted session's own
    unknown = b.get("/v1/sessions/no-such-session")
    for response in (b.get(f"/v1/sessions/{sid}"), b.post(f"/v1/sessions/{sid}/messages", json={"content": "x"}),
                     b.post(f"/v1/sessions/{sid}/fork", json={"at_message": 0}), b.delete(f"/v1/sessions/{sid}")):
        assert (response.status_code, response.json()) == (404, unknown.json())  # even with the owner secret
    assert b.get("/v1/sessions").json()["sessions"] == []
    listed = [s["id"] for s in a.get("/v1/sessions").json()["sessions"]]
    store = tenant_server.state.sessions
    assert store is not None and sid in listed and all(store._sessions[i].tenant == "alpha" for i in listed)
    fork = a.post(f"/v1/sessions/{sid}/fork", json={"at_message": 2})
    assert fork.status_code == 201, fork.text
    child = store._sessions[fork.json()["id"]]
    assert (child.tenant, child.cache_salt) == ("alpha", "conversation-1")
    third = a.post(f"/v1/sessions/{child.id}/messages", json={"content": "Forked"}).json()
    assert third["usage"]["cached_tokens"] >= second["usage"]["prompt_tokens"] - 16  # the parent's salted prefix

    async def resume(key: str) -> dict[str, Any]:
        async with connect(tenant_server, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            assert (await recv_frame(ws))["type"] == "auth.ok"
            await ws.send(json.dumps({"type": "session.resume", "session_id": sid, "owner": SECRET}))
            return await recv_frame(ws)

    assert asyncio.run(resume(ALPHA_ADMIN))["type"] == "session.resumed"
    refused = asyncio.run(resume(BETA_USER))
    assert (refused["type"], refused["code"]) == ("error", "unknown_session")


def test_a_websocket_chat_hits_its_own_tenant_only(tenant_server: BackgroundServer) -> None:
    system = system_prompt("websocket")

    async def first_turn(key: str, salt: str | None = None) -> int:
        async with connect(tenant_server) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            assert (await recv_frame(ws))["type"] == "auth.ok"
            create = {"type": "session.create", "system_prompt": system, "sampling": TINY, "owner": SECRET}
            await ws.send(json.dumps(create))
            sid = (await recv_frame(ws))["session"]["id"]
            chat = {"type": "chat", "session_id": sid, "content": "Hi", "gen_id": "g", "owner": SECRET}
            await ws.send(json.dumps({**chat, **({"cache_salt": salt} if salt else {})}))
            while (frame := await recv_frame(ws))["type"] != "start":
                assert frame["type"] != "error", frame
            return int(frame["cached_tokens"])

    assert asyncio.run(first_turn(BETA_USER)) < MISS
    assert asyncio.run(first_turn(ALPHA_USER)) < MISS
    assert asyncio.run(first_turn(ALPHA_ADMIN)) > MISS
    assert asyncio.run(first_turn(ALPHA_ADMIN, salt="turn-salt")) == 0  # a namespace nothing was cached in


def test_previous_response_id_does_not_cross_tenants(tenant_server: BackgroundServer) -> None:
    model = tenant_server.state.model_name
    headers = {OWNER_HEADER: SECRET}
    first = client(tenant_server, ALPHA_USER).responses.create(model=model, input="Hi", max_output_tokens=1,
                                                                extra_headers=headers)
    with pytest.raises(openai.NotFoundError):
        client(tenant_server, BETA_USER).responses.create(model=model, input="More", max_output_tokens=1,
                                                          previous_response_id=first.id, extra_headers=headers)
    with pytest.raises(openai.NotFoundError):
        client(tenant_server, BETA_USER).responses.retrieve(first.id, extra_headers=headers)
    follow = client(tenant_server, ALPHA_USER).responses.create(model=model, input="More", max_output_tokens=1,
                                                                 previous_response_id=first.id, extra_headers=headers)
    assert follow.previous_response_id == first.id


# -- who sees which figures -------------------------------------------------------------------------

def test_a_users_stats_say_nothing_of_other_tenants_traffic() -> None:
    """The body a user key gets is a function of its tenant's figures and the pools' capacity only:
    two engines with nothing else in common give the same body, with every key of the admin's."""
    quiet = EngineStats(blocks_total=64, blocks_free=64, host_blocks_total=32, host_blocks_free=32)
    busy = EngineStats(blocks_total=64, blocks_free=3, blocks_used=40, blocks_cached=21, tree_nodes=90,
                       tree_tokens=5000, num_running=7, num_waiting=9, prompt_tokens=10**6, cached_tokens=9 * 10**5,
                       computed_tokens=10**5, generation_tokens=777, cache_hit_requests=55, evictions=12,
                       evicted_blocks=30, preemptions=4, host_blocks_total=32, host_blocks_free=1, host_nodes=8,
                       host_tokens=300, host_cached_tokens=5000, loaded_blocks=40, written_back_blocks=60,
                       swaps_out=2, swaps_in=2, requests_finished=Counter(stop=60), new_token_ratio=0.4,
                       admission_blocked=Counter(blocks=5), spec_proposed=Counter(tree=9))
    usage = TenantUsage()
    usage.add(Usage(prompt_tokens=100, cached_tokens=60, completion_tokens=5, host_cached_tokens=20))
    rows = [{"tenant": "beta", "id": "none", "preview": "(no system prompt)"}]
    mine = tenant_cache_stats_json(busy, 16, usage, 2, rows)
    assert mine == tenant_cache_stats_json(quiet, 16, usage, 2, rows)
    admin = cache_stats_json(busy, 16, 5, rows)
    assert mine.keys() == admin.keys() and all(
        mine[k].keys() == admin[k].keys() for k in mine if isinstance(mine[k], dict))
    assert (mine["requests"], mine["prompt_tokens"], mine["cached_tokens"], mine["host_cached_tokens"]) == (1, 100, 60, 20)
    assert mine["hit_rate"] == 0.6 and mine["generation_tokens"] == 5 and mine["sessions"] == 2
    assert mine["blocks"] == {"total": 64, "free": 0, "used": 0, "cached": 0, "block_size": 16}
    assert mine["host"]["enabled"] and mine["host"]["blocks"] == {"total": 32, "free": 0, "used": 0}


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_user_sees_only_its_own_tenant_and_an_admin_sees_every_tenant(tenant_server: BackgroundServer) -> None:
    alpha_prompt, beta_prompt = system_prompt("alpha-stats"), system_prompt("beta-stats")
    chat_cached(tenant_server, ALPHA_USER, alpha_prompt)
    chat_cached(tenant_server, BETA_USER, beta_prompt)
    chat_cached(tenant_server, BETA_USER, beta_prompt)
    admin = http(tenant_server, ROOT).get("/v1/cache/stats").json()
    beta = http(tenant_server, BETA_USER).get("/v1/cache/stats").json()
    assert beta.keys() == admin.keys() and beta["host"].keys() == admin["host"].keys()
    assert (admin["scope"], beta["scope"], beta["tenant"], beta["role"]) == ("all", "tenant", "beta", "user")
    by_tenant = {t["tenant"]: t for t in admin["tenants"]}
    assert {"alpha", "beta"} <= by_tenant.keys()
    assert [t["tenant"] for t in beta["tenants"]] == ["beta"] and beta["tenants"][0] == by_tenant["beta"]
    own = by_tenant["beta"]
    assert (beta["requests"], beta["prompt_tokens"], beta["cached_tokens"]) == (
        own["requests"], own["prompt_tokens"], own["cached_tokens"])
    assert beta["cached_tokens"] > 0 and admin["requests"] > beta["requests"]
    # nothing that reflects other tenants' traffic; the pool's capacity is shown
    assert beta["tree"] == {"nodes": 0, "tokens": 0} and beta["evictions"] == 0 and beta["running"] == 0
    assert beta["blocks"]["total"] == admin["blocks"]["total"] > 0 and beta["blocks"]["cached"] == 0
    assert admin["tree"]["nodes"] > 0
    assert {r["tenant"] for r in beta["system_prompts"]} == {"beta"}
    assert {r["tenant"] for r in admin["system_prompts"]} >= {"alpha", "beta"}
    # a key's holder sees its own tenant's prompt text, an admin every tenant's
    beta_text = json.dumps(beta)
    assert " ".join(beta_prompt.split())[:40] in beta_text and alpha_prompt[:40] not in beta_text
    assert alpha_prompt[:40] in json.dumps(admin) and beta_prompt[:40] in json.dumps(admin)

    user_metrics = http(tenant_server, BETA_USER).get("/metrics").text
    samples = metric_samples(user_metrics)
    assert samples[("radixserve_tenant_requests_total", (("tenant", "beta"),))] == own["requests"]
    assert 'tenant="alpha"' not in user_metrics and alpha_prompt[:40] not in user_metrics
    assert "radixserve_radix_tree_nodes" not in user_metrics and "radixserve_prompt_tokens_total" not in user_metrics
    assert samples[("radixserve_kv_blocks_total", ())] == admin["blocks"]["total"]
    admin_metrics = http(tenant_server, ROOT).get("/metrics").text
    assert 'tenant="alpha"' in admin_metrics and 'tenant="beta"' in admin_metrics
    assert "radixserve_radix_tree_nodes" in admin_metrics


def test_an_open_server_hides_prompt_text_unless_the_operator_allows_it(
        tiny_chat_server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> None:
    system = system_prompt("open-server")
    reply = httpx.post(f"{tiny_chat_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_chat_server.state.model_name, "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]})
    assert reply.status_code == 200, reply.text
    shown = " ".join(system.split())[:40]

    def texts() -> tuple[str, str]:
        return httpx.get(f"{tiny_chat_server.url}/v1/cache/stats").text, httpx.get(f"{tiny_chat_server.url}/metrics").text

    stats, metrics = texts()
    assert shown not in stats and shown not in metrics
    assert any(r["tenant"] == "default" and r["preview"] == "" and r["requests"] >= 1
               for r in json.loads(stats)["system_prompts"])
    monkeypatch.setattr(tiny_chat_server.state.config, "show_prompt_previews", True)
    stats, metrics = texts()
    assert shown in stats and shown[:40] in metrics
