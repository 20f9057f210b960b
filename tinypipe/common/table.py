"""Plain-text tables and human units for people (the `--json` output is for programs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tinypipe.common.units import GIB


def gib(nbytes: float) -> str:
    """Bytes as GiB with two decimals: `15.04 GiB`."""
    return f"{nbytes / GIB:,.2f} GiB"


def human_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: `512 B`, `3.0 MiB`."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    v = float(nbytes)
    for u in units:
        if abs(v) < 1024 or u == units[-1]:
            return f"{v:,.0f} {u}" if u == "B" else f"{v:,.1f} {u}"
        v /= 1024
    return f"{v:.1f} TiB"


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None) -> str:
    """A table with a header rule; numbers right-aligned unless `align` gives 'l'/'r' per column."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(headers))]
    if align is None:
        align = "".join("r" if rows and all(_numeric(r[j]) for r in rows) else "l" for j in range(len(headers)))

    def line(r: list[str]) -> str:
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(r, widths, align)).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)
