"""`radixserve bench`: workloads, peer systems, metrics, reports and charts for the prefix cache.

Data flows one way: workloads (token-level, deterministic by seed) -> driver (closed/open loop
clients against one system) -> traces -> metrics / cache simulations -> report (table, JSON, charts).
Nothing here is imported by the engine.
"""
