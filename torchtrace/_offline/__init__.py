"""Offline: trace files read back, summarised, turned into an HTML report or a Perfetto trace."""
