"""Units of bytes: the binary ones, and parsing sizes given by people (`24GiB`, `1.5TB`, `1073741824`)."""

from __future__ import annotations

import re

from tinypipe.common.errors import InputError

MIB = 2**20
GIB = 2**30

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": MIB, "gib": GIB, "tib": 2**40, "k": 2**10, "m": MIB, "g": GIB, "t": 2**40}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, where: str = "size") -> int:
    """`24GiB` -> 25769803776. Decimal units (GB) are powers of 10, binary (GiB, or bare G) of 2."""
    m = _RE.match(text)
    if not m or m[2].lower() not in _UNITS:
        raise InputError(f"{where}: cannot read {text!r} as a size; write e.g. 24GiB, 512MiB or 1.5TB")
    value = float(m[1]) * _UNITS[m[2].lower()]
    if value <= 0:
        raise InputError(f"{where}: must be > 0, got {text!r}")
    return int(value)
