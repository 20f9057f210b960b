"""Shipped data: model configs, hardware presets and profiled traces (JSON), found by name."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

KINDS = ("models", "hardware", "profiles", "calibration")


def folder(kind: str) -> Path:
    """The folder holding shipped JSON files of one kind (`models`, `hardware`, `profiles`, `calibration`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown shipped-data kind {kind!r}; expected one of {KINDS}")
    return Path(str(resources.files(__name__))) / kind


def names(kind: str) -> list[str]:
    """Names of the shipped files of one kind, without the `.json` suffix, sorted."""
    return sorted(p.stem for p in folder(kind).glob("*.json"))


def path(kind: str, name: str) -> Path | None:
    """The shipped file `name` of `kind`, or None when there is none."""
    p = folder(kind) / f"{name}.json"
    return p if p.is_file() else None
