"""`radixserve bench agent`: the agent-loop workload (issue 48, Deliver 4): tasks of tool round trips over
a long, growing context on the three APIs (chat completions, Responses, Anthropic Messages), cache on
against cache off, and the scheduler's step with many agent loops in flight.

    tools.py     the twenty tool schemas and their shape on each API
    workload.py  the tasks: round trips, tool outputs (seeded real text), fitted into the context
    client.py    the HTTP loops on each API, streamed, in a process of their own: usage and TTFT per turn
    runner.py    servers (one per API and cache mode), warm-up, the runs, the scheduler phase
    analysis.py  per-turn / per-run figures, on vs off, the scheduler's steps, headline and targets
    report.py    the Markdown table
    chart.py     agents.png
    cli.py       the subcommand's flags and entry point

Invariants: every figure is read from the servers' usage, the client's clocks or the engine's own
phase clock, never typed in; the workload is deterministic by seed and identical across APIs and
cache modes.
"""

SCENARIO = "agents"
