"""The agent workload's tools: twenty function tools of a coding / operations agent (files, shell, git,
tests, issues, logs, metrics, SQL, web), each with a realistic name, description and parameter
schema, and their shape on each API (OpenAI chat `tools`, Responses `tools`, Anthropic `tools`).

Parameters are written with the structured bench's schema helpers: strings carry a maxLength, numbers
bounds, and choices enums, so a forced call's arguments end within a small max_tokens even on a 135M
model (its grammar keeps every call inside the schema), and the calls stay short beside the tool
outputs the workload appends, as an agent's calls are.

Invariants: names are unique; every `parameters` is a valid Draft 2020-12 object schema; the three
API shapes carry the same name, description and schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve_bench.structured.schemas import Schema, arr, b, e, i, obj, s

_PATH = s(32)  # a repository path
_REPO = s(32)
_SERVICE = e("api-gateway", "billing", "checkout", "search", "auth", "worker")


@dataclass(frozen=True)
class AgentTool:
    name: str
    description: str
    parameters: Schema

    def chat(self) -> dict[str, Any]:
        """The tool as an entry of chat completions' `tools`."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def responses(self) -> dict[str, Any]:
        """The tool as an entry of the Responses API's `tools` (flat, with `strict`)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": False}

    def anthropic(self) -> dict[str, Any]:
        """The tool as an entry of the Messages API's `tools`."""
        return {"name": self.name, "description": self.description, "input_schema": self.parameters}


TOOLS: tuple[AgentTool, ...] = (
    AgentTool("read_file", "Read a text file of the repository, optionally a range of its lines.",
              obj({"path": _PATH, "start_line": i(1, 100000), "end_line": i(1, 100000)}, ("path",))),
    AgentTool("write_file", "Create or overwrite a file of the repository with the given content.",
              obj({"path": _PATH, "content": s(32)})),
    AgentTool("edit_file", "Replace one exact occurrence of old_text in a file by new_text.",
              obj({"path": _PATH, "old_text": s(32), "new_text": s(32)})),
    AgentTool("list_directory", "List the entries of a directory of the repository.",
              obj({"path": _PATH, "recursive": b(), "max_entries": i(1, 500)}, ("path",))),
    AgentTool("search_code", "Search the repository's files for a regular expression; returns matching lines.",
              obj({"pattern": s(32), "path_glob": s(32), "case_sensitive": b(), "max_results": i(1, 200)},
                  ("pattern",))),
    AgentTool("run_shell", "Run a shell command in the sandbox and return its exit status, stdout and stderr.",
              obj({"command": s(32), "cwd": _PATH, "timeout_s": i(1, 600)}, ("command",))),
    AgentTool("run_tests", "Run the test suite or a subset of it (pytest node ids or a -k expression).",
              obj({"target": s(32), "keyword": s(32), "fail_fast": b()}, ("target",))),
    AgentTool("git_diff", "Show the working tree's changes against a ref, optionally for some paths only.",
              obj({"ref": s(32), "paths": arr(_PATH, 0, 2), "staged": b()}, ())),
    AgentTool("git_log", "Show recent commits, optionally only those touching a path.",
              obj({"max_count": i(1, 100), "path": _PATH, "since": s(10, pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")},
                  ())),
    AgentTool("get_issue", "Fetch an issue of a repository with its comments.",
              obj({"repo": _REPO, "number": i(1, 1000000)})),
    AgentTool("create_issue", "Open an issue in a repository.",
              obj({"repo": _REPO, "title": s(32), "body": s(32),
                   "labels": arr(e("bug", "enhancement", "docs", "question", "performance"), 0, 3)},
                  ("repo", "title"))),
    AgentTool("list_pull_requests", "List a repository's pull requests by state and author.",
              obj({"repo": _REPO, "state": e("open", "closed", "all"), "author": s(24)}, ("repo",))),
    AgentTool("read_logs", "Read a service's recent log lines at or above a level, optionally filtered.",
              obj({"service": _SERVICE, "level": e("debug", "info", "warning", "error"),
                   "since_minutes": i(1, 1440), "grep": s(32)}, ("service",))),
    AgentTool("get_metrics", "Read one metric of a service over a recent window, as a time series.",
              obj({"service": _SERVICE, "metric": e("latency_p50", "latency_p99", "error_rate", "requests_per_s",
                                                    "cpu", "memory"),
                   "window_minutes": i(1, 1440)}, ("service", "metric"))),
    AgentTool("kubectl_get", "List Kubernetes objects of a kind in a namespace.",
              obj({"kind": e("pod", "deployment", "service", "node", "configmap", "job"), "namespace": s(32),
                   "selector": s(32)}, ("kind",))),
    AgentTool("sql_query", "Run a read-only SQL query against one of the analytics databases.",
              obj({"database": e("analytics", "billing", "users"), "query": s(32), "limit": i(1, 1000)},
                  ("database", "query"))),
    AgentTool("web_search", "Search the web; returns titles, URLs and snippets.",
              obj({"query": s(32), "top_k": i(1, 10), "site": s(32)}, ("query",))),
    AgentTool("fetch_url", "Fetch a web page or an HTTP API and return its body as text.",
              obj({"url": s(32),
                   "method": e("GET", "HEAD"), "timeout_s": i(1, 60)}, ("url",))),
    AgentTool("python_eval", "Evaluate a short Python snippet in a scratch interpreter and return its output.",
              obj({"code": s(32)})),
    AgentTool("send_message", "Post a message to a team chat channel.",
              obj({"channel": s(24), "text": s(32)})),
)
