"""`tinypipe.train`: `tinypipe run` from Python, its flags as keywords, a callback per step, the metrics returned.

The keywords are `tinypipe run`'s flags with underscores (`--batch-tokens 512` is `batch_tokens=512`, a switch
such as `--no-save` is `no_save=True`, `--compile` / `--no-compile` is `compile=True` / `False`); a value of
None leaves the flag out. They become the command line `tinypipe run` parses, so every value is read and
checked as the command reads it, and a bad one is the same one-line `InputError`. An unknown keyword is a
TypeError naming it. The backend (torch) is imported when a run starts, so `import tinypipe` needs no torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tinypipe.common.errors import InputError

if TYPE_CHECKING:
    from tinypipe.backends.launch.run import RunOutcome

StepMetrics = dict[str, Any]  # one line of metrics.jsonl: step, loss, lr, grad_norm, tokens, tokens_per_s, ...


@dataclass(frozen=True)
class TrainResult:
    """What a `tinypipe.train` run did and measured: the numbers of `tinypipe run`'s report, as values."""

    out: str  # the output directory: the model (or LoRA adapter), checkpoints, metrics.jsonl
    step: int  # the steps done (a resumed run's earlier ones included)
    stopped: bool  # stopped before the end (the callback or Ctrl-C): checkpointed, the model in OUT/step-N
    metrics: tuple[StepMetrics, ...]  # metrics.jsonl's lines of the steps this call trained, in step order
    losses: dict[int, float]  # step (1-based) -> the step's mean token loss
    eval_losses: dict[int, float]  # step (1-based) -> held-out loss after it (`eval_data`, `eval_fraction`)
    tokens_per_s: float  # measured over the steady steps (the report's speed line; 0 when none ran)
    predicted_tokens_per_s: float  # the simulator's, for the same schedule
    accuracy_before: float | None  # held-out addition accuracy of the embedded task (None: not measured)
    accuracy_after: float | None
    peak_device_bytes: dict[int, int]  # rank -> its device's peak bytes allocated
    peak_rss_bytes: int  # the workers' peak resident memory, summed
    host_state_bytes: int  # the host state of every rank's layers (masters, moments, gradients), summed
    report: str  # the report `tinypipe run` prints

    @property
    def loss(self) -> float | None:
        """The last step's loss."""
        return self.losses[max(self.losses)] if self.losses else None


def train(*, callback: Callable[[StepMetrics], object] | None = None, **options: Any) -> TrainResult | None:
    """Train as `tinypipe run` does with `options` (its flags with underscores), printing what it prints, and
    return the run's `TrainResult` (None on a torchrun rank other than 0).

    `callback(metrics)` hears each step's line of metrics.jsonl on rank 0, in step order, in this process.
    Returning False or raising `tinypipe.StopTraining` stops the run as Ctrl-C does: the window running
    finishes, a checkpoint and the model at the stop are written (`resume=True` continues), and the result
    says `stopped`. Any other exception stops it the same way and is raised here once the ranks have finished.
    """
    args = parse_options(options)
    from tinypipe.backends.launch.run import execute
    from tinypipe.backends.rank.stepfeed import LocalFeed

    from .edge import run_options

    feed = LocalFeed(callback or _keep_going)
    outcome = execute(run_options(args), feed=feed)
    if feed.error is not None:
        raise feed.error
    return None if outcome is None else _result(outcome, feed.rows)


def _keep_going(metrics: StepMetrics) -> None:
    return None


def parse_options(options: Mapping[str, Any]) -> argparse.Namespace:
    """`tinypipe run`'s parsed command line for `options`; TypeError for a keyword that is no flag of it."""
    from tinypipe.cli import build_parser

    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    run: argparse.ArgumentParser = sub.choices["run"]
    missing = run.get_default("_run_missing")
    if missing:
        raise InputError(f"tinypipe.train needs the torch extra: pip install 'tinypipe[torch]' ({missing})")
    flags = {opt[2:].replace("-", "_"): (opt, action) for action in run._actions
             for opt in action.option_strings if opt.startswith("--") and opt != "--help"}
    argv = ["run"]
    for key, value in options.items():
        if key not in flags:
            near = difflib.get_close_matches(key, flags, n=1)
            raise TypeError(f"train() got an unexpected keyword argument {key!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + "; its keywords are `tinypipe run`'s flags with underscores")
        if value is not None:
            argv += _words(*flags[key], value)
    return ap.parse_args(argv)


def _words(opt: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line words that give flag `opt` the value `value`."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise InputError(f"tinypipe run: argument {opt}: a switch, True or False; got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [opt if value else _negated(opt)]
        return [opt] if value else []
    if isinstance(value, Mapping):
        return [opt, json.dumps(value)]
    many = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
    if isinstance(action, argparse._AppendAction):
        return [w for v in (value if many else [value]) for w in (opt, str(v))]
    return [opt, *map(str, value)] if many else [opt, str(value)]


def _negated(opt: str) -> str:
    return "--" + opt[5:] if opt.startswith("--no-") else "--no-" + opt[2:]


def _result(outcome: RunOutcome, rows: list[StepMetrics]) -> TrainResult:
    from tinypipe.backends.launch.run_report import steady_step_s

    plan, results = outcome.plan, outcome.results
    losses = {k + 1: v for r in results for k, v in r.losses.items()}
    step_s = steady_step_s(plan, results)
    return TrainResult(
        out=str(plan.job.out), step=min(r.start_step for r in results) + max(r.steps_run for r in results),
        stopped=any(r.interrupted for r in results), metrics=tuple(rows), losses=dict(sorted(losses.items())),
        eval_losses={k + 1: v for r in results for k, v in sorted(r.eval_losses.items())},
        tokens_per_s=plan.batch_tokens / step_s if step_s > 0 else 0.0,
        predicted_tokens_per_s=plan.prediction.tokens_per_s, accuracy_before=outcome.before,
        accuracy_after=outcome.after, peak_device_bytes={r.rank: r.peak_device_bytes for r in results},
        peak_rss_bytes=sum(r.peak_rss_bytes for r in results),
        host_state_bytes=sum(int(r.held["total_bytes"]) for r in results), report=outcome.report)
