"""Sizes given by people parse to bytes; bad ones are one-line errors."""

import pytest

from tinypipe.common.errors import InputError
from tinypipe.common.units import parse_bytes


def test_parse_bytes() -> None:
    """Binary and decimal units, bare numbers."""
    assert [parse_bytes(s) for s in ("24GiB", "1.5TB", "512MiB", "1024", "2g")] == [
        24 * 2**30, 1_500_000_000_000, 512 * 2**20, 1024, 2 * 2**30]


@pytest.mark.parametrize("s", ["", "GiB", "-1GiB", "3 parsecs", "0"])
def test_bad_sizes(s: str) -> None:
    """Unreadable or non-positive sizes name the option."""
    with pytest.raises(InputError, match="--gpu-mem"):
        parse_bytes(s, "--gpu-mem")
