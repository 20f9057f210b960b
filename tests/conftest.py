"""Test-wide settings: under CI (CI=true) Hypothesis runs derandomized, so a run is repeatable; Hugging Face
offline."""

from __future__ import annotations

import os

from hypothesis import settings

# nothing downloads in tests: a Hugging Face Hub id resolves through the (test-made) cache or is an error
os.environ.setdefault("HF_HUB_OFFLINE", "1")

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
