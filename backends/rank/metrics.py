"""What a run reports while it trains: a progress line with ETA, and `OUT/metrics.jsonl` (TensorBoard too).

Rank 0 gathers, after each window, every rank's losses (the head's) and squared gradient norms (each
rank's share over its layers, `HostState.grad_sq`) and keeps them in a `StepLog`. A step's line is
written once every rank's optimizer steps for it have finished (a window's last optimizer steps may
run on into the next window), so `metrics.jsonl` trails the progress line by up to one window.

One JSON object per line: `step` (1-based), `loss` (the step's mean token loss), `lr`, `grad_norm`
(the global L2 norm of the step's gradients over all ranks, before any update), `tokens`,
`tokens_per_s` (of the window the step ran in) and `elapsed_s`; `eval_loss` where measured.
With `tensorboard` installed (torch.utils.tensorboard), the same scalars go to OUT/tensorboard (`train/<key>`);
with `report_to="wandb"` (`--report-to wandb`), every number of the line goes to a Weights & Biases run
(`train/<key>` at `step`; `wandb.init(dir=OUT)`, so WANDB_MODE=offline keeps it under OUT/wandb). `on_row`
hears each line as written (`stepfeed`: the Python API's callback).

Held-out evaluation is not training: a window's tokens/s is its training steps' alone, and the ETA is
the remaining steps at the training time per step so far, plus the evaluations still due at the mean
time of those measured (`eta_s`).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

METRICS_FILE, TENSORBOARD_DIR = "metrics.jsonl", "tensorboard"


def fmt_duration(s: float) -> str:
    """Seconds as `1:02:03` or `2:03`."""
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def evals_after(step: int, steps: int, every: int | None) -> int:
    """Evaluations still due after step `step` of `steps`: every `every` steps and at the end (0: at the end
    only; None: no evaluation)."""
    if every is None or step >= steps:
        return 0
    if every == 0:
        return 1
    return steps // every - step // every + (1 if steps % every else 0)


def eta_s(*, done: int, left: int, train_s: float, evals_left: int, eval_s: float, evals: int) -> float:
    """Seconds to the end: `left` steps at the training time per step of the `done` so far (`train_s`), and
    `evals_left` evaluations at the mean of the `evals` measured (`eval_s` in all; none measured yet: 0)."""
    return train_s / max(1, done) * left + (eval_s / evals * evals_left if evals else 0.0)


def progress_line(step: int, steps: int, loss: float | None, tokens_per_s: float, eta_s: float | None) -> str:
    width = 24
    filled = int(width * step / max(1, steps))
    return (f"training [{'#' * filled}{'.' * (width - filled)}] step {step}/{steps}"
            + ("" if loss is None else f"  loss {loss:.4f}") + f"  {tokens_per_s:,.0f} tokens/s"
            + ("" if eta_s is None else f"  ETA {fmt_duration(eta_s)}"))


class StepLog:
    """Rank 0's record of the run's steps: progress on stderr, metrics.jsonl (and TensorBoard) under `out`."""

    def __init__(self, out: str | None, *, steps: int, start: int, tokens_per_step: int, ranks: int,
                 lr_at: Callable[[int], float], progress: bool = True, stream: TextIO | None = None,
                 norms: bool = True, eval_every: int | None = None, report_to: str | None = None,
                 config: dict[str, Any] | None = None, on_row: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.steps, self.start, self.tokens_per_step, self.ranks = steps, start, tokens_per_step, ranks
        self.lr_at, self.progress, self.stream, self.norms = lr_at, progress, stream or sys.stderr, norms
        self.eval_every = eval_every  # evaluations every N steps and at the end (0: at the end; None: none)
        self.eval_s, self.evals = 0.0, 0  # seconds spent evaluating, and how many evaluations
        self.t0 = time.perf_counter()
        self.losses: dict[int, float] = {}
        self.grad_sq: dict[int, list[float]] = {}  # step -> each rank's share that has arrived
        self.rate: dict[int, float] = {}  # step -> tokens/s of its window
        self.eval: dict[int, float] = {}
        self.written = start
        self._file: TextIO | None = None
        self._board: Any = None
        self._wandb: Any = None
        self.on_row = on_row  # each line as written (the Python API's callback, `stepfeed`)
        if out is not None:
            path = Path(out) / METRICS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = _rows_upto(path, start) if start else []  # a resumed run continues the file from its checkpoint
            self._file = open(path, "w")  # noqa: SIM115 - closed in close()
            self._file.writelines(kept)
            self._board = _tensorboard(Path(out) / TENSORBOARD_DIR, resumed_at=start)
            if report_to == "wandb":
                self._wandb = _wandb_run(out, config or {})

    def window(self, first: int, last: int, seconds: float, parts: Iterable[tuple[dict[int, float],
                                                                                    dict[int, float]]],
               eval_loss: float | None = None, eval_s: float = 0.0) -> None:
        """Steps first..last-1 ran in `seconds`; `parts`: every rank's (losses, grad_sq) it gathered;
        `eval_loss`: the held-out loss after step `last`, if measured, in `eval_s` seconds."""
        if eval_loss is not None:
            self.eval[last - 1] = eval_loss
        if eval_s:
            self.eval_s, self.evals = self.eval_s + eval_s, self.evals + 1
        for losses, sq in parts:
            self.losses.update(losses)
            for k, v in sq.items():
                self.grad_sq.setdefault(k, []).append(v)
        rate = self.tokens_per_step * (last - first) / max(seconds, 1e-9)
        for k in range(first, last):
            self.rate[k] = rate
        if self.progress:
            train_s = time.perf_counter() - self.t0 - self.eval_s
            eta = eta_s(done=last - self.start, left=self.steps - last, train_s=train_s, eval_s=self.eval_s,
                        evals=self.evals, evals_left=evals_after(last, self.steps, self.eval_every))
            line = progress_line(last, self.steps, self.losses.get(last - 1), rate, eta)
            held = "" if eval_loss is None else f"  eval loss {eval_loss:.4f} ({eval_s:.1f} s)"
            self._say(line + held, final=last == self.steps)
        self._flush(complete_only=True)

    def _say(self, text: str, *, final: bool) -> None:
        if self.stream.isatty():
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _flush(self, *, complete_only: bool) -> None:
        while self.written < self.steps:
            k = self.written
            if k not in self.rate or (complete_only and self.norms and len(self.grad_sq.get(k, ())) < self.ranks):
                return
            sq = self.grad_sq.get(k)
            row: dict[str, Any] = {"step": k + 1, "loss": self.losses.get(k), "lr": self.lr_at(k),
                                   "grad_norm": math.sqrt(sum(sq)) if sq and len(sq) == self.ranks else None,
                                   "tokens": self.tokens_per_step, "tokens_per_s": round(self.rate[k], 1),
                                   "elapsed_s": round(time.perf_counter() - self.t0, 3)}
            if k in self.eval:
                row["eval_loss"] = self.eval[k]
            self._write(row)
            self.written += 1

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._board is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"):
                if row.get(key) is not None:
                    self._board.add_scalar(f"train/{key}", row[key], row["step"])
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in row.items() if k != "step" and v is not None},
                            step=row["step"])
        if self.on_row is not None:
            self.on_row(row)

    def close(self, parts: Iterable[tuple[dict[int, float], dict[int, float]]] = ()) -> None:
        """The last shares (after every optimizer step finished), then every remaining line."""
        for losses, sq in parts:
            self.losses.update(losses)
            for k, v in sq.items():
                self.grad_sq.setdefault(k, []).append(v)
        self._flush(complete_only=False)
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _rows_upto(path: Path, step: int) -> list[str]:
    """The lines of an earlier metrics.jsonl for steps up to `step` (those after it are trained again)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def _tensorboard(directory: Path, *, resumed_at: int = 0) -> Any:
    """A TensorBoard SummaryWriter when the tensorboard package is installed, else None. A run resumed after
    `resumed_at` steps hides the earlier run's scalars of the steps it trains again (`purge_step`), as
    metrics.jsonl drops their lines."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(directory), purge_step=resumed_at + 1 if resumed_at else None)


def _wandb_run(out: str, config: dict[str, Any]) -> Any:
    """A Weights & Biases run for the metrics, named after --out and kept in it (OUT/wandb), its config the run's
    options; `wandb.init` takes its project, entity and mode from the WANDB_* environment variables."""
    import wandb

    return wandb.init(name=Path(out).name, dir=out, config=config)
