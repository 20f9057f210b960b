"""Offline policy search: candidates, lower bounds that prune, ranking by simulated throughput and footprint."""
