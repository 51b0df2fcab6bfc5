"""Scratch: one peers workload against a running server, then its speculation metrics."""
import asyncio, sys, httpx
from radixserve_bench.harness import model_facts
from radixserve_bench.peers.client import measure
from radixserve_bench.peers.runner import run_metrics
from radixserve_bench.peers.servers import request_body
from radixserve_bench.peers.workload import PeersOptions, build_peer_workloads
url, name = sys.argv[1], sys.argv[2]
o = PeersOptions()
model_dir, display, spec, tok = model_facts(o.model)
enc = lambda t: list(tok.encode(t, add_special_tokens=False)); dec = lambda ids: str(tok.decode(ids))
ws = {w.name: w for w in build_peer_workloads(o, enc, dec)}
w = ws[name]
model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
run = asyncio.run(measure(url, w, lambda m, n: request_body("radixserve", model, m, n), 1800, lambda _: None))
m = run_metrics(run, w)
print({k: round(v, 1) for k, v in m.items() if k in ("output_tokens_per_s", "ttft_ms_mean", "decode_tok_s_mean")})
for line in httpx.get(url + "/metrics").text.splitlines():
    if ("spec" in line or "draft" in line) and not line.startswith("#"):
        print(line)
