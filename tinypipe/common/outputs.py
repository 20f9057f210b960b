"""Output paths checked before any work starts, so a long command never fails at its last step.

A directory counts as writable when a probe file can be created in it and removed: that answers
for read-only mounts, permissions, quotas and root alike, where `os.access` guesses.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tinypipe.common.errors import InputError


def _probe(directory: Path) -> str | None:
    """None when a file can be created in `directory`, else why not."""
    try:
        fd, name = tempfile.mkstemp(prefix=".tinypipe-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


def check_file(path: Path, flag: str) -> None:
    """InputError unless `path` can be created or replaced as a file (its directory exists and is writable)."""
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise InputError(f"{flag} {path}: {parent} {what}")
    why = _probe(parent)
    if why is not None:
        raise InputError(f"{flag} {path}: cannot write in {parent} ({why})")


def check_dir(path: Path, flag: str) -> None:
    """InputError unless `path` is a writable directory, or can be created as one."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: exists and is not a directory")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{flag} {path}: {ancestor} is not a directory")
    why = _probe(ancestor)
    if why is not None:
        raise InputError(f"{flag} {path}: cannot write in {ancestor} ({why})")
