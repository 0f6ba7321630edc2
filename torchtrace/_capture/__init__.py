"""Capture: what runs inside the model's forward and backward (traced forwards, hooks, statistics, device work)."""
