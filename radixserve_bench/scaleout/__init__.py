"""`radixserve bench scale-out`: N engine replicas behind one Ray Serve ingress, compared with one replica.

Three systems, each a real Ray Serve application on 127.0.0.1 (radixserve.scaleout.bench_cluster):
`cache-aware` and `power-of-two` (2 replicas of P blocks each, the two request routers) and
`one-replica` (1 replica of 2P blocks: the same memory in one pool). Two chat workloads built from
the bench's token-level generators (many system-prompt groups; many conversations whose turns
interleave), sized so they overflow one pool of P blocks but fit in 2P, sent over HTTP to
/v1/chat/completions. Plus a micro-benchmark of the routing rule itself (no Ray).

Modules: `plan` (options, workloads as chats, pool sizing, systems), `client` (the HTTP driver),
`runner` (clusters and results), `report` (targets, table), `chart` (scale_out.png), `routing_micro`
(RoutingTable.choose() + sent() cost), `cli` (the subcommand's flags). What it shares with the main
run (options, the command from flags to written and published files) comes from bench's plan.py,
flags.py and harness.py.
"""

from __future__ import annotations

SCENARIO = "scale-out"
SYSTEMS = ("cache-aware", "power-of-two", "one-replica")
WORKLOADS = ("shared-prefix", "multi-turn")
REFERENCE = "one-replica"
HIT_RATE_GOAL = 0.95  # cache-aware hit rate / one-replica's, at least
ROUTING_US_GOAL = 1000.0  # routing overhead per request at 1,000 cached prefixes per replica, at most
