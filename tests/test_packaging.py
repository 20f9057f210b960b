"""The built wheel carries the shipped data (traces) and installs sim/ and backends/ inside tinypipe."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_traces_and_subpackages(tmp_path: Path) -> None:
    """`pip wheel .` puts every shipped JSON and the tinypipe.sim / tinypipe.backends modules in the wheel."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("tinypipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"tinypipe/traces/{p.relative_to(ROOT / 'traces')}" for p in (ROOT / "traces").rglob("*.json")}
    assert shipped and shipped <= names
    assert {"tinypipe/sim/engine.py", "tinypipe/backends/run.py", "tinypipe/cli/__init__.py",
            "tinypipe/backends/profile/layers.py", "tinypipe/backends/data/batches.py"} <= names
