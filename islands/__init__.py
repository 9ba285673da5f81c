"""islands: Decoupled DiLoCo across regions that talk only through object storage.

The subpackages are layers, and imports point down only (`make lint` checks it):
core (the pure algorithm) < storage < tasks (units of work) < infra < ops (operator tools) <
flows (Prefect flows and the CLI).
"""
