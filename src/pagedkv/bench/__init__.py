"""Benchmarks as package code: seeded workloads, a baseline side by side, a table and `--json`."""
