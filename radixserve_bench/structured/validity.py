"""Validity: every schema's constrained replies (greedy, and sampled with fixed seeds) judged against
the schema; every tool's calls under tool_choice "required" (all tools offered, the model picks) and
named (this tool), judged against the called tool's parameters.

Invariants: all of a part's requests are queued together on one engine and run to the end (the
batch mixes schemas, modes and seeds as a server's would); a reply is judged by measure.judge, a
tool reply first parsed by the model's tool-call format (`ToolCallFormat.parse`, parallel calls off:
the first call is the call) and then judged on its arguments; every non-valid reply is listed with
its text, so a failure can be read, not only counted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from radixserve.chat.tool_calls import ToolLike
from radixserve.engine.llm import LLM
from radixserve.sampling_params import SamplingParams
from radixserve.structured import StructuredOutput
from radixserve_bench.structured.measure import Job, Reply, Verdict, judge, run_jobs, tally, validator_for
from radixserve_bench.structured.schemas import BenchSchema
from radixserve_bench.structured.tool_defs import BenchTool

SHOWN_TEXT = 300  # characters of a failed reply kept in the results


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 256
    samples: int = 2  # sampled replies per schema / tool and choice, besides the greedy one
    temperature: float = 0.8
    seed: int = 0

    def modes(self) -> list[tuple[str, SamplingParams]]:
        """("greedy", params), then ("sampled-<seed>", params) per sample."""
        out = [("greedy", SamplingParams(max_tokens=self.max_tokens, temperature=0.0))]
        out += [(f"sampled-{self.seed + k}", SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                                                            seed=self.seed + k)) for k in range(1, self.samples + 1)]
        return out


def _failure(key: str, verdict: Verdict, reply: Reply) -> dict[str, Any]:
    return {"key": key, "verdict": verdict.verdict, "why": verdict.why, "tokens": reply.tokens,
            "text": reply.text[:SHOWN_TEXT]}


def _summary(rows: list[tuple[str, Verdict]]) -> dict[str, Any]:
    """Tallies overall, greedy and sampled."""
    return {"all": tally([v for _, v in rows]), "greedy": tally([v for m, v in rows if m == "greedy"]),
            "sampled": tally([v for m, v in rows if m != "greedy"])}


def schema_validity(llm: LLM, schemas: list[BenchSchema], sampling: Sampling) -> dict[str, Any]:
    """Every schema's replies, judged; per-schema verdicts, tallies and the failures."""
    jobs, meta = [], []
    for bs in schemas:
        prompt = llm.formatter.prompt_tokens(bs.messages())
        for mode, params in sampling.modes():
            constrained = dataclasses.replace(params, structured=StructuredOutput(json=bs.schema, field=f"bench.{bs.name}"))
            jobs.append(Job(f"{bs.name}/{mode}", prompt, constrained))
            meta.append((bs, mode))
    replies = run_jobs(llm.engine, jobs)
    rows: list[tuple[str, Verdict]] = []
    per_schema: dict[str, dict[str, Any]] = {}
    failures = []
    validators = {bs.name: validator_for(bs.schema) for bs in schemas}
    for (bs, mode), reply in zip(meta, replies):
        verdict = judge(reply, validators[bs.name])
        rows.append((mode, verdict))
        entry = per_schema.setdefault(bs.name, {"family": bs.family, "verdicts": {}, "tokens": {}})
        entry["verdicts"][mode], entry["tokens"][mode] = verdict.verdict, reply.tokens
        if verdict.verdict != "valid":
            failures.append(_failure(reply.key, verdict, reply))
    families = {f: tally([v for (bs, _), (_, v) in zip(meta, rows) if bs.family == f])
                for f in dict.fromkeys(bs.family for bs in schemas)}
    return {"schemas": len(schemas), "modes": [m for m, _ in sampling.modes()], "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature, **_summary(rows), "families": families,
            "reply_tokens_mean": sum(r.tokens for r in replies) / len(replies), "per_schema": per_schema,
            "failures": failures}


def tool_validity(llm: LLM, tools: list[BenchTool], sampling: Sampling) -> dict[str, Any]:
    """Each tool's question asked with tool_choice "required" and named (this tool), every tool offered."""
    from radixserve.chat.tools import ToolChoice

    offered: list[ToolLike] = [t.openai() for t in tools]
    by_name = {t.name: t for t in tools}
    validators = {t.name: validator_for(t.parameters) for t in tools}
    jobs, meta, readers = [], [], {}
    for choice_name in ("required", "named"):
        for tool in tools:
            choice = ToolChoice("required") if choice_name == "required" else ToolChoice("named", tool.name)
            chat_tools = llm.chat_tools(offered, choice, parallel_tool_calls=False)
            assert chat_tools is not None
            readers[(choice_name, tool.name)] = chat_tools
            prompt = llm.formatter.prompt_tokens([{"role": "user", "content": tool.question}],
                                                 chat_tools.template_tools())
            for mode, params in sampling.modes():
                jobs.append(Job(f"{choice_name}:{tool.name}/{mode}", prompt, chat_tools.constrain(params)))
                meta.append((choice_name, tool, mode))
    replies = run_jobs(llm.engine, jobs)
    rows: dict[str, list[tuple[str, Verdict]]] = {"required": [], "named": []}
    failures, picked = [], 0
    for (choice_name, tool, mode), reply in zip(meta, replies):
        verdict, called = _judge_call(reply, readers[(choice_name, tool.name)].format, validators, by_name,
                                      tool.name if choice_name == "named" else None)
        picked += choice_name == "required" and called == tool.name
        rows[choice_name].append((mode, verdict))
        if verdict.verdict != "valid":
            failures.append(_failure(reply.key, verdict, reply))
    every = rows["required"] + rows["named"]
    required_total = len(rows["required"])
    fmt = readers[("required", tools[0].name)].format.name
    return {"tools": len(tools), "modes": [m for m, _ in sampling.modes()], "format": fmt,
            "all": tally([v for _, v in every]), "required": _summary(rows["required"]), "named": _summary(rows["named"]),
            "required_picked_intended_pct": 100.0 * picked / required_total if required_total else float("nan"),
            "failures": failures}


def _judge_call(reply: Reply, fmt: Any, validators: dict[str, Any], tools: dict[str, BenchTool],
                named: str | None) -> tuple[Verdict, str | None]:
    """(verdict, the called tool's name): the reply must parse into a call of an offered tool (the named
    one, if any) whose arguments validate against its parameters."""
    if reply.finish_reason == "length" or reply.error or reply.finish_reason not in ("stop", None):
        return judge(reply, None), None
    calls = fmt.parse(reply.text).calls
    if not calls:
        return Verdict("invalid", "no tool call parsed from the reply"), None
    call = calls[0]
    if call.name not in tools or (named is not None and call.name != named):
        return Verdict("invalid", f"called {call.name!r}" + (f", not the named {named!r}" if named else "")), call.name
    try:
        arguments = json.loads(call.arguments)
    except ValueError as e:
        return Verdict("invalid", f"arguments are not JSON: {e}"), call.name
    error = next(iter(validators[call.name].iter_errors(arguments)), None)
    if error is not None:
        return Verdict("invalid", f"{call.name} {'/'.join(map(str, error.path))}: {error.message}"), call.name
    return Verdict("valid"), call.name
