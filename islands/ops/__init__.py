"""Operator tools that only read a run's storage (and the Prefect API): status, audit, export, plots."""
