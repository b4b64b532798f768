"""``gateway demo``: the simulated GPU server, a realistic workload, and a before/after
table measured in that run."""

from gateway.demo.run import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
