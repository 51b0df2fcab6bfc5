"""The first reply token's top log-probabilities from llama-server's two attention paths, for four of
the agreement check's prompts (their token IDs from llama_agreement.json beside this file).

Started by hand before it, on the shipped GGUF, 2 threads:
    .peers/llama-server -m <the GGUF> --host 127.0.0.1 --port 8231 -t 2 -c 256 -np 1 -fa on
    .peers/llama-server -m <the GGUF> --host 127.0.0.1 --port 8232 -t 2 -c 256 -np 1 -fa off
Output: first_token_probe_out.txt (prompt index, port, the top three (token, log-probability)).
"""
import json
from pathlib import Path

import httpx

d = json.loads((Path(__file__).parent / "llama_agreement.json").read_text())
for idx in (2, 14, 4, 0):
    p = d["prompts_token_ids"][idx]
    for port in (8231, 8232):
        r = httpx.post(f"http://127.0.0.1:{port}/completion",
                       json={"prompt": p, "n_predict": 1, "temperature": 0, "top_k": 1, "n_probs": 4,
                             "cache_prompt": False, "return_tokens": True}, timeout=60).json()
        cp = r["completion_probabilities"][0]
        print(idx, port, [(t["id"], round(t["logprob"], 4)) for t in cp["top_logprobs"]][:3])
