"""Training-state checkpoints, one file per rank, published atomically for all ranks at once.

Layout under the run's output directory:

    checkpoint/meta.json       step to continue from, the run's identity (checked on --resume) and its
                               options (`run`: what --resume restores; see settings.py)
    checkpoint/rank{r}.pt      rank r's host state (masters, AdamW state, versions), losses, RNG states
    checkpoint.old/            the checkpoint before it (the last two are kept)

Writing goes to `checkpoint.tmp/` (every rank writes its file there, itself via a temporary name,
an fsync and a rename); once all ranks are done, rank 0 writes meta.json, deletes the previous
`checkpoint.old/`, moves `checkpoint/` to `checkpoint.old/` and renames `checkpoint.tmp/` to
`checkpoint/`. A crash or kill -9 at any point leaves a complete `checkpoint/` or a complete
`checkpoint.old/`; `find` takes the newest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError

DIR, TMP, OLD = "checkpoint", "checkpoint.tmp", "checkpoint.old"
FORMAT = "tinypipe.checkpoint/1"
LATER_KEYS = ("pack_sizes", "pack_gpu")  # identity keys that checkpoints written before them lack


def rng_state() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write: Callable[[Any], None]) -> None:
    """Write `path` through `write(file)` via a temporary name, fsync, then rename: all or nothing."""
    part = path.with_name(f".{path.name}.part")
    with open(part, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def save(out_dir: str | Path, *, rank: int, step: int, identity: dict[str, Any], state: dict[str, Any],
         barrier: Callable[[], None], run: dict[str, Any] | None = None) -> Path:
    """Every rank calls this at the same step; returns the published directory. `run` is recorded, not checked."""
    import torch

    out = Path(out_dir)
    tmp = out / TMP
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _write_synced(tmp / f"rank{rank}.pt", lambda f: torch.save({"format": FORMAT, "step": step, **state}, f))
    barrier()
    if rank == 0:
        meta = {"format": FORMAT, "step": step, **identity, "run": run or {}}
        _write_synced(tmp / "meta.json", lambda f: f.write((json.dumps(meta, indent=2) + "\n").encode()))
        _fsync_dir(tmp)
        final, old = out / DIR, out / OLD
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(out)
    barrier()
    return out / DIR


def find(out_dir: str | Path) -> Path | None:
    """The complete checkpoint directory under `out_dir`, or None."""
    for name in (DIR, OLD):
        d = Path(out_dir) / name
        if (d / "meta.json").is_file():
            return d
    return None


def read_record(directory: Path) -> dict[str, Any]:
    """The checkpoint's meta.json as it is (InputError when it is not a readable tinypipe checkpoint)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{directory}/meta.json: cannot read the checkpoint ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise InputError(f"{directory}: not a tinypipe checkpoint (format {found!r})")
    if not isinstance(meta.get("step"), int) or not isinstance(meta.get("run", {}), dict):
        raise InputError(f"{directory}/meta.json: malformed checkpoint record (step or run)")
    return meta


def read_meta(directory: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's meta.json, checked against this run's `identity` (InputError on a mismatch)."""
    meta = read_record(directory)
    for key, want in identity.items():
        if key in LATER_KEYS and key not in meta:
            continue
        if meta.get(key) != want:
            raise InputError(f"--resume: the checkpoint in {directory} was made with {key}={meta.get(key)!r}, "
                             f"this run has {key}={want!r}; resume with the same settings or use a new --out")
    return meta


def load(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / f"rank{rank}.pt"
    if not path.is_file():
        raise InputError(f"{path}: missing; the checkpoint does not match this run's ranks")
    import torch

    state: dict[str, Any] = torch.load(path, weights_only=False)  # written by `save`
    return state
