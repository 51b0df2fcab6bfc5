"""`radixserve bench llama-agreement` against a stand-in llama-server (no peer is built in tests): a
script that serves llama-server's /health, /v1/models and /completion on the port it is given,
answers from the prompt's token IDs, and records what it was asked and with which flash-attention
switch. The check must send radixserve's prompt tokens, force the reply's length, run llama.cpp with
flash attention on and off, stop each server, and count agreement from the replies."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import psutil
import pytest
from tiny_models import tiny_chat_model_dir

from radixserve.cli import main
from radixserve_bench.checks.greedy_agreement import QUESTIONS

# replies: the prompt's last tokens; with flash attention off, a prompt of even length gets its last
# reply token changed, so the two runs differ on exactly the even-length prompts
FAKE_SERVER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port, fa = int(argv[argv.index("--port") + 1]), argv[argv.index("-fa") + 1]
record = open(sys.argv[0] + ".requests.jsonl", "a")
class Handler(BaseHTTPRequestHandler):
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send({"status": "ok"} if self.path == "/health" else {"data": [{"id": "fake.gguf"}]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        record.write(json.dumps({"fa": fa, "body": body}) + "\\n"); record.flush()
        prompt, n = body["prompt"], body["n_predict"]
        tokens = (prompt * n)[-n:]
        if fa == "off" and len(prompt) % 2 == 0:
            tokens[-1] += 1
        self._send({"tokens": tokens, "content": ""})
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_llama_agreement_asks_both_attention_paths_for_radixserve_s_prompt_tokens(tmp_path: Path) -> None:
    server = tmp_path / "peers" / "llama-server"
    server.parent.mkdir()
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "agreement.json"
    rc = main(["bench", "llama-agreement", "--peers-dir", str(server.parent), "--model",
               str(tiny_chat_model_dir("llama")), "--gguf", str(tmp_path / "m.gguf"), "--tokens", "3",
               "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    result = json.loads(out.read_text())
    prompts = result["prompts_token_ids"]
    assert len(prompts) == len(QUESTIONS) == result["prompts"]
    requests = [json.loads(line) for line in Path(f"{server}.requests.jsonl").read_text().splitlines()]
    assert [r["fa"] for r in requests] == ["on"] * len(prompts) + ["off"] * len(prompts)
    for r, prompt in zip(requests, prompts + prompts):
        assert r["body"]["prompt"] == prompt
        assert r["body"]["n_predict"] == 3 and r["body"]["ignore_eos"] and r["body"]["top_k"] == 1
    even = [len(p) % 2 == 0 for p in prompts]
    assert 0 < sum(even) < len(prompts)  # the check below can tell a swapped count
    itself = result["pairs"]["llama.cpp-fa-off vs llama.cpp"]
    assert itself["identical"] == len(prompts) - sum(even)
    assert itself["leading_tokens_agreeing"] == [2 if e else 3 for e in even]
    for name in ("radixserve", "radixserve-float32-activations"):
        assert all(len(reply) == 3 for reply in result["replies"][name])  # forced to the length asked
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(server) in " ".join(p.info["cmdline"] or [])]


def test_llama_agreement_without_llama_server_says_how_to_build_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "llama-agreement", "--peers-dir", str(tmp_path), "--gguf", str(tmp_path / "m.gguf")])
    assert rc == 2
    assert f"{tmp_path / 'llama-server'} is not there; build it with `make peers-llama`" in \
        capsys.readouterr().out
