"""Training-state checkpoints, one file per rank, published atomically for all ranks at once.

Layout under the run's output directory:

    checkpoint/meta.json       step to continue from, world size, what the run was (for --resume checks)
    checkpoint/rank{r}.pt      rank r's host state (masters, AdamW state, versions), losses, RNG states

Writing goes to `checkpoint.tmp/` (every rank writes its file there, itself via a temporary name
and a rename); once all ranks are done, rank 0 writes meta.json, moves the old `checkpoint/` to
`checkpoint.old/`, renames `checkpoint.tmp/` to `checkpoint/` and deletes the old one. A crash at
any point leaves a complete `checkpoint/` or a complete `checkpoint.old/`; `find` takes either.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinypipe.errors import InputError

DIR, TMP, OLD = "checkpoint", "checkpoint.tmp", "checkpoint.old"
FORMAT = "tinypipe.checkpoint/1"


def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(out_dir: str | Path, *, rank: int, step: int, identity: dict[str, Any], state: dict[str, Any],
         barrier: Callable[[], None]) -> Path:
    """Every rank calls this at the same step; returns the published directory."""
    out = Path(out_dir)
    tmp = out / TMP
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    part = tmp / f".rank{rank}.pt.part"
    torch.save({"format": FORMAT, "step": step, **state}, part)
    os.replace(part, tmp / f"rank{rank}.pt")
    barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "step": step, **identity}, indent=2) + "\n")
        final, old = out / DIR, out / OLD
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return out / DIR


def find(out_dir: str | Path) -> Path | None:
    """The complete checkpoint directory under `out_dir`, or None."""
    for name in (DIR, OLD):
        d = Path(out_dir) / name
        if (d / "meta.json").is_file():
            return d
    return None


def read_meta(directory: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's meta.json, checked against this run's `identity` (InputError on a mismatch)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{directory}/meta.json: cannot read the checkpoint ({exc})") from None
    if meta.get("format") != FORMAT:
        raise InputError(f"{directory}: not a tinypipe checkpoint (format {meta.get('format')!r})")
    for key, want in identity.items():
        if meta.get(key) != want:
            raise InputError(f"--resume: the checkpoint in {directory} was made with {key}={meta.get(key)!r}, "
                             f"this run has {key}={want!r}; resume with the same settings or use a new --out")
    return meta


def load(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / f"rank{rank}.pt"
    if not path.is_file():
        raise InputError(f"{path}: missing; the checkpoint does not match this run's ranks")
    return torch.load(path, weights_only=False)  # type: ignore[no-any-return]
