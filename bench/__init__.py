"""Benchmarks: each compares the direct path and the gateway path in one run."""
