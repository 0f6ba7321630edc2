"""Sinks in the process: in-memory records, the per-layer summary, Prometheus metrics, SDK spans."""
