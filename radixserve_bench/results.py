"""The results document: per-run detail, environment (machine, versions, date), ratios to peers and
the issue's targets, each marked met / missed / not measured with its margin."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import os
import platform
from typing import Any

from radixserve_bench import returning, speculation
from radixserve_bench.driver import RunTrace
from radixserve_bench.metrics import blocks_timeline, hit_rate_timeline
from radixserve_bench.systems import REFERENCE

MAX_TIMELINE_POINTS = 400


def _thin(points: list, limit: int = MAX_TIMELINE_POINTS) -> list:
    """Evenly thin a timeline, keeping the first, the last and the maximum of column 1."""
    if len(points) <= limit:
        return points
    keep = {0, len(points) - 1, max(range(len(points)), key=lambda i: points[i][1])}
    step = len(points) / limit
    keep |= {int(i * step) for i in range(limit)}
    return [points[i] for i in sorted(keep)]


def run_detail(trace: RunTrace, extra: dict[str, Any]) -> dict[str, Any]:
    requests = [{
        "id": r.request_id, "session": r.session_id, "group": r.group, "turn": r.turn, "prompt_len": r.prompt_len,
        "output_len": r.output_len, "cached_tokens": r.cached_tokens, "send_s": round(r.send_time - trace.start, 4),
        "ttft_ms": round(1000 * r.ttft_s, 3), "e2e_ms": round(1000 * r.e2e_s, 3),
        "itl_ms_mean": round(1000 * sum(r.itl_s) / len(r.itl_s), 3) if r.itl_s else 0.0,
        **({"drafts": r.drafts} if r.drafts else {}), **({"steps": r.steps} if r.steps else {}),
        **({"decode_tok_s": round(r.decode_tokens_per_s, 3)} if r.decode_tokens_per_s else {}),
    } for r in trace.records]
    timeline = {
        "hit_rate": [[round(t, 4), round(h, 5)] for t, h in hit_rate_timeline(trace)],
        "blocks": [[round(t, 4), u, c] for t, u, c in _thin(blocks_timeline(trace.pool_samples, trace.start))],
    }
    return {"engine": extra.get("engine", {}), "timeline": timeline, "requests": requests}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def add_environment(results: dict, options: Any, model: tuple[str, str], spec: Any | None,
                    argv: list[str] | None) -> None:
    """The date, command, machine, versions, model (None figures without a spec) and options."""
    import torch

    results["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results["command"] = "radixserve bench " + " ".join(argv) if argv is not None else None
    results["machine"] = {
        "platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    results["versions"] = {"python": platform.python_version(), "radixserve": version("radixserve"),
                           "torch": torch.__version__, "transformers": version("transformers"),
                           "triton": version("triton")}
    results["model"] = {"dir": model[0], "name": model[1], "layers": getattr(spec, "num_layers", None),
                        "kv_heads": getattr(spec, "num_kv_heads", None), "head_dim": getattr(spec, "head_dim", None),
                        "vocab_size": getattr(spec, "vocab_size", None)}
    results["options"] = {k: v for k, v in dataclasses.asdict(options).items()}


def ratios(results: dict) -> dict[str, dict[str, dict[str, float]]]:
    """radixserve (cache on) against every other system of the same workload."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for wname, per_system in results["results"].items():
        ref = per_system.get(REFERENCE, {}).get("median")
        if not ref:
            continue
        out[wname] = {}
        for name, entry in per_system.items():
            peer = entry.get("median")
            if name == REFERENCE or not peer:
                continue
            out[wname][name] = {
                key: ref[key] / peer[key]
                for key in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "ttft_ms_mean",
                            "ttft_ms_p50", "e2e_ms_p50")
                if peer.get(key)
            }
    return out


@dataclasses.dataclass
class Target:
    name: str
    op: str  # ">=" or "<="
    threshold: float
    value: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        met = None if self.value is None else (self.value >= self.threshold if self.op == ">=" else
                                                self.value <= self.threshold)
        margin = None
        if self.value is not None and self.value > 0:
            margin = self.value / self.threshold - 1 if self.op == ">=" else self.threshold / self.value - 1
        return {"name": self.name, "op": self.op, "threshold": self.threshold, "value": self.value, "met": met,
                "margin": margin, "note": self.note}


def _median(results: dict, workload: str, system: str) -> dict[str, float] | None:
    return results["results"].get(workload, {}).get(system, {}).get("median")


def evaluate_targets(results: dict) -> list[dict[str, Any]]:
    targets = []

    def ratio(workload: str, a: str, b: str, key: str) -> float | None:
        ma, mb = _median(results, workload, a), _median(results, workload, b)
        if not ma or not mb or key not in ma or not mb.get(key):
            return None
        return ma[key] / mb[key]

    for peer, threshold in (("hf-generate-batch", 2.0), ("hf-generate", 5.0)):
        targets.append(Target(f"shared-prefix output tok/s, radixserve / {peer}", ">=", threshold,
                              ratio("shared-prefix", REFERENCE, peer, "output_tokens_per_s")))
    targets.append(Target("multi-turn mean TTFT, radixserve / hf-generate-batch", "<=", 0.5,
                          ratio("multi-turn", REFERENCE, "hf-generate-batch", "ttft_ms_mean")))
    mt = _median(results, "multi-turn", REFERENCE)
    late = None
    if mt:
        turns = sorted(int(k.removeprefix("ttft_ms_turn")) for k in mt if k.startswith("ttft_ms_turn"))
        late = 10 if 10 in turns else (turns[-1] if turns else None)
    targets.append(Target(f"multi-turn TTFT turn {late or 10} / turn 1 (radixserve)", "<=", 1.5,
                          mt[f"ttft_ms_turn{late}"] / mt["ttft_ms_turn1"] if mt and late and mt.get("ttft_ms_turn1")
                          else None, "" if late in (None, 10) else f"the workload has {late} turns"))
    targets.append(Target("random output tok/s, cache on / cache off", ">=", 0.99,
                          ratio("random", REFERENCE, "radixserve-nocache", "output_tokens_per_s")))
    for workload in ("shared-prefix", "multi-turn"):
        m = _median(results, workload, REFERENCE)
        targets.append(Target(f"{workload} hit rate / optimal (ample memory)", ">=", 0.99,
                              m["hit_rate_vs_optimal"] if m else None))
    targets += [Target(name, op, goal, value) for name, op, goal, value in returning.target_values(results)]
    targets += [Target(name, op, goal, value) for name, op, goal, value in speculation.target_values(results)]
    sched = results.get("micro", {}).get("scheduler", {}).get("256")
    targets.append(Target("scheduler CPU ms per step, 256 running sequences", "<=", 1.0,
                          sched["cpu_ms_per_step"] if sched else None))
    return [t.as_dict() for t in targets]
