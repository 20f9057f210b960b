"""The peers runner's tests (`python -m bench test`): its package lives in bench/ (`peers`), outside the
installed packages, so bench/ goes on the path."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2]  # bench/
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
