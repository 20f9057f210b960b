"""Shared helpers of the bench scripts: machine facts, writing JSON results, printing tables."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """The checkout's commit (`-dirty` with uncommitted changes), or "unknown" outside a git checkout."""
    res = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent)
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and at which commit."""
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit()}


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write bench/results/<name> with the machine facts added."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str) + "\n")
    return path
