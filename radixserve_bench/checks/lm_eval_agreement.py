"""lm-evaluation-harness against `radixserve serve`: a log-likelihood (multiple-choice) task run through
`local-completions` (the server's /v1/completions with `echo` + `logprobs`) and through lm-eval's own
`hf` backend on the same model directory, and every per-choice log-likelihood compared.

lm-eval is not a radixserve dependency (it pulls in datasets, evaluate, scikit-learn, ...): install it
in a venv of its own and name its `lm_eval` executable:

    python -m venv /tmp/lme && /tmp/lme/bin/pip install torch "lm-eval[api]" transformers accelerate
    radixserve bench lm-eval --lm-eval /tmp/lme/bin/lm_eval --publish docs/bench/api-clients

The task is written at run time (no model hub, no dataset download): `QUESTIONS` below, four choices
each, as an lm-eval YAML task over a local JSON file. The model is the embedded SmolLM2 unless
--model names a directory; both sides run it in float32 on the CPU. Exits non-zero when any
log-likelihood differs by more than --tolerance, or the greedy flags differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Which animal says meow?", ["dog", "cow", "duck", "cat"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("How many days are in a week?", ["five", "six", "ten", "seven"], 3),
    ("What is the opposite of hot?", ["cold", "big", "fast", "loud"], 0),
    ("Which season comes after winter?", ["autumn", "spring", "summer", "winter"], 1),
    ("What do you use to write on paper?", ["a spoon", "a shoe", "a pen", "a cup"], 2),
    ("Which fruit is yellow and curved?", ["apple", "grape", "cherry", "banana"], 3),
    ("What is two plus two?", ["four", "three", "five", "six"], 0),
    ("Where do fish live?", ["in trees", "in water", "in the desert", "in the sky"], 1),
    ("Which instrument has black and white keys?", ["drum", "flute", "piano", "violin"], 2),
    ("What gas do people breathe in to live?", ["helium", "carbon", "neon", "oxygen"], 3),
]

TASK = """task: radixserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_task(folder: Path) -> None:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "radixserve_mc.yaml").write_text(TASK.format(data=data))


def model_dir(name: str | None) -> str:
    from radixserve.model.embedded import resolve_model

    return resolve_model(name)[0]


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.load(r).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit("the server did not become ready")


def run_lm_eval(lm_eval: str, model: str, args: str, tasks: Path, out: Path) -> dict[tuple[int, int], tuple[float, bool]]:
    """Per (question, choice): (log-likelihood, is greedy) from lm-eval's logged samples."""
    cmd = [lm_eval, "--model", model, "--model_args", args, "--tasks", "radixserve_mc", "--include_path", str(tasks),
           "--log_samples", "--output_path", str(out), "--batch_size", "1", "--device", "cpu"]
    started = time.monotonic()
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    print(f"lm_eval --model {model}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    samples = next(out.rglob("samples_radixserve_mc_*.jsonl"))
    got: dict[tuple[int, int], tuple[float, bool]] = {}
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        for choice, resp in enumerate(doc["resps"]):
            logprob, greedy = resp[0]
            got[(doc["doc_id"], choice)] = (float(logprob), str(greedy) == "True")
    return got


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--lm-eval", required=True, help="the lm_eval executable (a venv with lm-eval[api] and accelerate)")
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2)")
    ap.add_argument("--tolerance", type=float, default=1e-3)
    ap.add_argument("--publish", type=Path, default=None, help="write lm_eval.md and lm_eval.json into this folder")


def run(a: argparse.Namespace) -> int:
    directory = model_dir(a.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", *(["--model", a.model] if a.model else [])])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_task(work)
            wait_ready(url, server)
            with urllib.request.urlopen(url + "/v1/models") as r:
                served = json.load(r)["data"][0]["id"]
            api = run_lm_eval(a.lm_eval, "local-completions",
                              f"model={served},base_url={url}/v1/completions,tokenizer={directory},"
                              "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
                              work, work / "api")
            hf = run_lm_eval(a.lm_eval, "hf", f"pretrained={directory},dtype=float32", work, work / "hf")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return report(api, hf, a.tolerance, a.publish)


def report(api: dict[tuple[int, int], tuple[float, bool]], hf: dict[tuple[int, int], tuple[float, bool]],
           tolerance: float, publish: Path | None) -> int:
    """Print (and with `publish` write) the comparison; 0 when it passes, else 1."""
    assert api.keys() == hf.keys(), "both runs answer the same (question, choice) pairs"
    diffs = {k: abs(api[k][0] - hf[k][0]) for k in api}
    worst = max(diffs.values())
    greedy_same = all(api[k][1] == hf[k][1] for k in api)
    picks = {side: [max(range(4), key=lambda c, q=q: got[(q, c)][0]) for q in range(len(QUESTIONS))]  # type: ignore[misc]
             for side, got in (("api", api), ("hf", hf))}
    accuracy = {side: sum(p == a for p, (_, _, a) in zip(picks[side], QUESTIONS)) / len(QUESTIONS) for side in picks}
    ok = worst <= tolerance and greedy_same and picks["api"] == picks["hf"]
    lines = [
        "# lm-evaluation-harness: local-completions against radixserve vs lm-eval's hf backend",
        "",
        f"Task: {len(QUESTIONS)} four-choice questions ({len(api)} log-likelihood requests), float32, CPU.",
        f"Command: `radixserve {shlex.join(sys.argv[1:])}`",
        "",
        "| | value |",
        "|---|---|",
        f"| largest per-choice log-likelihood difference | {worst:.2e} (tolerance {tolerance:g}) |",
        f"| mean difference | {sum(diffs.values()) / len(diffs):.2e} |",
        f"| greedy flags equal | {greedy_same} |",
        f"| same choice picked on every question | {picks['api'] == picks['hf']} |",
        f"| accuracy (radixserve / hf) | {accuracy['api']:.3f} / {accuracy['hf']:.3f} |",
        f"| result | {'PASS' if ok else 'FAIL'} |",
        "",
    ]
    print("\n".join(lines))
    if publish is not None:
        publish.mkdir(parents=True, exist_ok=True)
        (publish / "lm_eval.md").write_text("\n".join(lines))
        rows = [{"question": q, "choice": c, "radixserve": api[(q, c)][0], "hf": hf[(q, c)][0]} for q, c in sorted(api)]
        (publish / "lm_eval.json").write_text(json.dumps({"tolerance": tolerance, "max_diff": worst, "rows": rows},
                                                         indent=1))
    return 0 if ok else 1
