"""The Prometheus names the output statistics are published under (docs/metrics.md), spelled out once for tests."""

STATS_TO_METRICS = {
    "mean": "torchtrace_output_mean",
    "std": "torchtrace_output_std",
    "abs_max": "torchtrace_output_abs_max",
    "zero_fraction": "torchtrace_output_zero_ratio",
}
