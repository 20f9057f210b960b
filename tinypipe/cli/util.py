"""What the `tinypipe` commands share: a workload's policies, number limits, output checks, JSON and lists."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinypipe.common.errors import InputError

if TYPE_CHECKING:
    from tinypipe.describe.hardware import Hardware
    from tinypipe.describe.trace import ProfileTrace
    from tinypipe.describe.workload import Workload
    from tinypipe.policy import Policy


def policies(workload: Workload, hardware: Hardware, names: list[str], given: tuple[ProfileTrace, ...]
             ) -> list[tuple[Policy, ProfileTrace]]:
    """Each policy name's policy with the workload's overrides (`Workload.policy`) and its trace on `hardware`'s
    GPUs; a note on stderr (once) for each microbatch size that none of the `--profile` traces (`given`) matches."""
    from tinypipe.describe.trace import unmatched_note
    from tinypipe.policy import load_policy

    out = []
    for name in names:
        policy = workload.policy(load_policy(name))
        out.append((policy, workload.trace(policy, hardware.gpus[0])))
    notes = dict.fromkeys(unmatched_note(given, trace, workload.model) for _, trace in out)
    for note in notes:
        if note is not None:
            print(note, file=sys.stderr)
    return out


# the most a command line may ask for: beyond these, compiling and simulating takes hours (a schedule holds
# iterations x microbatches x layers actions), so a mistyped number is refused instead of run
LIMITS = {"seq_len": 1 << 24, "iterations": 64, "microbatches": 4096, "microbatch_size": 65536, "workers": 1024,
          "top": 100_000, "batch_tokens": 1 << 34}


def positive(flag: str, v: int) -> None:
    if v < 1:
        raise InputError(f"{flag}: must be >= 1, got {v}")


def at_most(flag: str, v: int, most: int) -> None:
    if v > most:
        raise InputError(f"{flag}: at most {most:,}, got {v:,}")


def print_json(obj: Any) -> int:
    print(json.dumps(obj, indent=2, default=str))
    return 0


def print_list(kind: str, names: list[str], as_json: bool) -> int:
    if as_json:
        return print_json(names)
    print(f"shipped {kind}: " + ", ".join(names))
    return 0


def check_outputs(**paths: str | None) -> None:
    """Fail before any work when an output file cannot be written (`--plot` also needs matplotlib)."""
    from tinypipe.common.outputs import check_file

    for flag, value in paths.items():
        if value is None:
            continue
        check_file(Path(value), "--" + flag.replace("_", "-"))
        if flag == "plot" and Path(value).exists():  # a picture is never drawn over a file the user has
            raise InputError(f"--plot {value}: the file exists; give a new name or remove it")
        if flag == "plot":
            from tinypipe.cli.plot import _pyplot

            formats = _pyplot().gcf().canvas.get_supported_filetypes()
            suffix = Path(value).suffix.lower().lstrip(".")
            if suffix and suffix not in formats:
                raise InputError(f"--plot {value}: .{suffix} is not a picture format; end the name with .png "
                                 f"(or .{', .'.join(sorted(f for f in formats if f != 'png'))})")


def plot_to(draw: Callable[..., Any], what: Any, path: str) -> None:
    """Draw a PNG; a file that cannot be written is an InputError."""
    try:
        draw(what, path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror or exc}") from None


def write_new(path: Path, text: str) -> None:
    """Write an output file atomically (temp file + rename) so a failure never leaves half a file."""
    if path.is_dir():
        raise InputError(f"{path}: is a directory; give a file name")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot write: {exc.strerror}") from None

