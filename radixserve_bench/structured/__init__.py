"""`radixserve bench structured`: the structured-output and tool-call workload (issue 26, item 7).

    schemas.py       the registry: BenchSchema, the families and JSON-schema features the catalog covers
    catalog_ours.py  our own schemas (API payloads, enums, nested objects, numeric bounds, patterns, ...)
    catalog_jsb.py   schemas of JSONSchemaBench's kinds (GitHub, Kubernetes, Snowplow, Washington Post,
                     GlaiveAI function arguments, JSONSchemaStore), written here, not copied
    tool_defs.py     the tool definitions and the questions that call them
    runner.py        runs it (one engine, then two differing in forced_tokens) and builds the results document
    measure.py       a batch of requests run to the end, the verdict on a reply, tallies
    timing.py        compile times, the constrained decode step beside the unconstrained one, forced tokens
    validity.py      schema replies and tool calls, judged
    report.py        the Markdown table and the issue's targets
    chart.py         structured.png

Invariants: every figure is measured on the run (nothing is typed in); the catalog's schemas are all
valid Draft 2020-12 schemas (tests/bench/test_bench_structured.py checks them and the features they cover).
"""

SCENARIO = "structured"
