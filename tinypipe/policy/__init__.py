"""Policies and their parts: packing, mapping, swapping, host memory, microbatching."""

from tinypipe.policy.policy import PRESETS, Policy, load_policy

__all__ = ["PRESETS", "Policy", "load_policy"]
