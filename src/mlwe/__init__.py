"""ML Workload Engine: a verified, deterministic, explainable scheduler for shared ML clusters."""

__version__ = "0.1.0"
