"""Benchmark scenarios, workloads and reports behind bench.py."""
