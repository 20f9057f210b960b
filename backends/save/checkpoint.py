"""Training-state checkpoints, one pair of files per rank, published atomically for all ranks at once.

Layout under the run's output directory:

    checkpoint/meta.json           step to continue from, the run's identity (checked on --resume) and its
                                   options (`run`: what --resume restores; see settings.py)
    checkpoint/rank{r}.safetensors rank r's tensors: host state (masters, optimizer state as held, quantised
                                   moments included), RNG states
    checkpoint/rank{r}.json        the rest of rank r's state (versions, losses, settings) with references
                                   to those tensors (`ckpt_format`: no pickle anywhere)
    checkpoint.old/, .old2/, ...   the checkpoints before it: `keep` complete ones are kept in all

Writing goes to `checkpoint.tmp/` (every rank writes its files there, each via a temporary name, an
fsync and a rename); once all ranks are done, rank 0 writes meta.json, renames `checkpoint/` to
`checkpoint.old/` (and older ones one further), renames `checkpoint.tmp/` to `checkpoint/`, then deletes
what is beyond `keep`. A crash or kill -9 at any point leaves a complete checkpoint; `find` takes the
newest. While one is written, the disk holds `keep` + 1 (`disk_bytes_needed`).

A write that fails on any rank (a full disk: ENOSPC) deletes `checkpoint.tmp/` and returns a `Failed`
naming the rank, the error and what is kept; the run goes on (`worker` prints it in one line).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tinypipe.common.errors import InputError

DIR, TMP, OLD = "checkpoint", "checkpoint.tmp", "checkpoint.old"
FORMAT = "tinypipe.checkpoint/2"  # /1 was pickled (rank{r}.pt); it is refused with a line saying so
# Complete checkpoints kept by default: one. The next is written beside it and published by renames, so
# a crash at any moment still leaves a complete one, and the disk holds two while one is written (two kept
# would need three: an 8B model's is ~48-96 GB; DESIGN §9).
DEFAULT_KEEP = 1
EDITED = "the checkpoint was edited or damaged: restore it, or start a new run in another --out"


class Group(Protocol):
    def barrier(self) -> None: ...

    def any_true(self, flag: bool) -> bool: ...


@dataclass(frozen=True)
class Failed:
    """A checkpoint that was not written: at `step`, on `rank`, why, and the newest complete one kept."""

    step: int
    rank: int
    why: str
    kept: str

    def line(self) -> str:
        return f"warning: checkpoint of step {self.step} not written (rank {self.rank}: {self.why}); {self.kept}"


def old_name(k: int) -> str:
    """The directory of the k-th checkpoint before the newest (1: checkpoint.old, 2: checkpoint.old2, ...)."""
    return OLD if k == 1 else f"{OLD}{k}"


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
         group: Group, run: dict[str, Any] | None = None, keep: int = DEFAULT_KEEP) -> Path | Failed:
    """Every rank calls this at the same step; returns the published directory, or `Failed` (every rank the
    same) when a rank could not write its files. `run` is recorded, not checked. `keep` >= 1."""
    from . import ckpt_format

    out = Path(out_dir)
    tmp = out / TMP
    error = ""
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = _why(exc)
    if not group.any_true(bool(error)):
        try:
            ckpt_format.write(tmp / f"rank{rank}", {"format": FORMAT, "step": step, **state}, _write_synced)
        except OSError as exc:
            error = _why(exc)
    failed = _first_failure(group, rank, error)
    if failed is None and rank == 0:
        try:
            meta = {"format": FORMAT, "step": step, **identity, "run": run or {}}
            _write_synced(tmp / "meta.json", lambda f: f.write((json.dumps(meta, indent=2) + "\n").encode()))
            _fsync_dir(tmp)
        except OSError as exc:
            error = _why(exc)
    if failed is None:
        failed = _first_failure(group, rank, error)
    if failed is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back
        group.barrier()
        newest = find(out)
        kept = (f"kept: {newest} (step {read_record(newest)['step']})" if newest is not None
                else "no earlier checkpoint is kept")
        return Failed(step, failed[0], failed[1], kept)
    if rank == 0:
        _publish(out, keep)
    group.barrier()
    return out / DIR


def _why(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def _first_failure(group: Group, rank: int, error: str) -> tuple[int, str] | None:
    """(rank, error) of the lowest failing rank, the same on every rank; None when none failed."""
    if not group.any_true(bool(error)):
        return None
    gather = getattr(group, "gather", None)
    errors = gather((rank, error)) if gather is not None else None
    if errors is None:  # only rank 0 gathers; the others learn that a write failed, and their own error
        return (rank, error) if error else (-1, "another rank could not write its files")
    return min(((r, e) for r, e in errors if e), default=(rank, error))


def _publish(out: Path, keep: int) -> None:
    """checkpoint.tmp/ -> checkpoint/ (the older ones one further), then only `keep` complete ones kept."""
    k = 1
    while (out / old_name(k)).exists():
        k += 1
    for j in range(k - 1, 0, -1):  # oldest first: checkpoint.old{j} -> checkpoint.old{j+1}
        os.replace(out / old_name(j), out / old_name(j + 1))
    final = out / DIR
    if final.exists():
        os.replace(final, out / OLD)
    os.replace(out / TMP, final)
    _fsync_dir(out)
    j = keep
    while (out / old_name(j)).exists():  # beyond `keep` (checkpoint/ is the first)
        shutil.rmtree(out / old_name(j))
        j += 1


def find(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory under `out_dir`, or None."""
    out = Path(out_dir)
    names = [DIR, OLD]
    k = 2
    while (out / old_name(k)).exists():
        names.append(old_name(k))
        k += 1
    for name in names:
        d = out / name
        if (d / "meta.json").is_file():
            return d
    return None


def held_bytes(out_dir: str | Path) -> int:
    """Bytes of the checkpoint directories already under `out_dir` (what a run's own checkpoints reuse)."""
    out = Path(out_dir)
    total = 0
    for d in (out / DIR, out / TMP, *(out / old_name(k) for k in range(1, 64))):
        if d.is_dir():
            total += sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    return total


def read_record(directory: Path) -> dict[str, Any]:
    """The checkpoint's meta.json as it is (InputError when it is not a readable tinypipe checkpoint)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{directory}/meta.json: cannot read the checkpoint ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        if found == "tinypipe.checkpoint/1":
            raise InputError(f"{directory}: a pickled checkpoint of an earlier tinypipe, which this one does not load "
                             "(checkpoints hold no pickle now); start a new run in another --out")
        raise InputError(f"{directory}: not a tinypipe checkpoint (format {found!r})")
    if not isinstance(meta.get("step"), int) or not isinstance(meta.get("run", {}), dict):
        raise InputError(f"{directory}/meta.json: malformed checkpoint record (step or run)")
    return meta


def check_record(directory: Path, meta: dict[str, Any]) -> None:
    """InputError, naming meta.json and its field, when the record contradicts itself: a negative step, a step
    past the run's last (`run.steps`), or the LoRA rank or optimizer state --resume would restore (`run.lora`,
    `run.optimizer_state`) other than those of the policy the checkpoint trained (`policy.*`). (`--model` an
    adapter directory records no `run.lora`: the adapter's rank is the policy's.)"""
    where, step, run = f"{directory}/meta.json", meta["step"], meta.get("run", {})
    last = run.get("steps")
    if step < 0:
        raise InputError(f"{where}: step {step}: a checkpoint's step is never negative; {EDITED}")
    if isinstance(last, int) and step > last:
        raise InputError(f"{where}: step {step} is past the run's last step (run.steps {last}); {EDITED}")
    policy = meta.get("policy")
    if not isinstance(policy, dict):
        return
    lora = policy.get("lora")
    rank = lora.get("rank") if isinstance(lora, dict) else None
    given = run.get("lora")
    from_adapter = given is None and Path(str(run.get("model"))).is_dir()
    if given != rank and not from_adapter:
        raise InputError(f"{where}: run.lora {_lora(given)}, but policy.lora {_lora(rank)}; {EDITED}")
    state = run.get("optimizer_state")
    if state is not None and state != policy.get("optimizer_state"):
        raise InputError(f"{where}: run.optimizer_state {state}, but policy.optimizer_state "
                         f"{policy.get('optimizer_state')}; {EDITED}")


def _lora(rank: Any) -> str:
    return "none (every parameter trains)" if rank is None else f"rank {rank}"


def read_meta(directory: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's meta.json, checked against this run's `identity` (InputError on a mismatch)."""
    meta = read_record(directory)
    for key, want in identity.items():
        if meta.get(key) != want:
            raise InputError(f"--resume: the checkpoint in {directory} was made with {key}={meta.get(key)!r}, "
                             f"this run has {key}={want!r}; resume with the same settings or use a new --out")
    return meta


def load(directory: Path, rank: int) -> dict[str, Any]:
    from . import ckpt_format

    stem = directory / f"rank{rank}"
    if not stem.with_name(stem.name + ckpt_format.TENSORS).is_file():
        raise InputError(f"{stem}{ckpt_format.TENSORS}: missing; the checkpoint does not match this run's ranks")
    try:
        state: dict[str, Any] = ckpt_format.read(stem)
    except (OSError, ckpt_format.FormatError) as exc:
        raise InputError(f"{stem}: cannot read the checkpoint ({exc})") from None
    return state
