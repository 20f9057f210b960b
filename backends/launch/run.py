"""`tinypipe run`: plan the run from its settled options, start the workers, then print the report.

With no arguments it runs the embedded job: the tiny byte-level Llama (`tiny-llama`) learning
multi-digit addition generated from the seed, on 2 CPU worker processes. The options are
registered in `run_flags`, settled into a `RunOptions` in `settings` (by the CLI), planned in `prepare`; the
report (`run_report.summary`) shows the loss curve, held-out addition accuracy before and after (for
the embedded task), tokens/s, peak device and host memory with bytes per parameter, and the
simulator's prediction for the same schedule beside each measurement. `execute` is the command's body,
which the Python API (`tinypipe.train`) calls too, with a callback that hears each step's metrics.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

if importlib.util.find_spec("torch") is None:  # the CLI registers `run` only when this imports
    raise ImportError("torch is not installed")

from .run_report import header, summary  # noqa: E402 - after the torch check
from .runtrace import save_trace  # noqa: E402 - after the torch check

if TYPE_CHECKING:
    from ..options.record import RunOptions
    from ..rank.stepfeed import LocalFeed
    from ..rank.worker import RankResult
    from .prepare import RunPlan

ACCURACY_MAX_PARAMS = 100_000_000  # larger models train on the addition task unscored (minutes of CPU forward)


@dataclass(frozen=True)
class RunOutcome:
    """What a run on rank 0 ended with: its plan, every rank's result, the held-out addition accuracy before
    and after (None: not measured), the report it printed, and its exit code (130: stopped early)."""

    plan: RunPlan
    results: list[RankResult]
    before: float | None
    after: float | None
    report: str
    code: int


def run_main(opts: RunOptions) -> int:
    """The `tinypipe run` command on its settled options (`settings.settle`); returns the exit code (user mistakes
    raise InputError)."""
    outcome = execute(opts)
    return 0 if outcome is None else outcome.code


def execute(opts: RunOptions, *, feed: LocalFeed | None = None) -> RunOutcome | None:
    """Plan, train, report (on stdout) on the settled options; None on a torchrun rank other than 0. `feed`: the
    Python API's callback, which hears rank 0's metrics rows and may stop the run (`stepfeed`)."""
    from tinypipe.common.errors import CapacityError, InputError
    from tinypipe.common.progress import Progress

    lead = int(os.environ.get("RANK", "0")) == 0  # torchrun starts every rank here; rank 0 reports
    note = Progress("run") if lead else None

    def phase(text: str) -> None:
        if note is not None:
            note.phase(text)

    phase("tinypipe run: loading PyTorch")
    from ..rank.rss_guard import stop_line
    from .prepare import make_run_plan
    from .spawn import launch

    plan = make_run_plan(opts, phase=phase)
    if note is not None:
        note.close()
        print("\n".join((header(plan), *plan.data_lines)), file=sys.stderr)
        if plan.note:
            print(plan.note, file=sys.stderr)
    before = None
    # the embedded task's accuracy is a forward of the whole model on this CPU: for the small models it suits
    scored = plan.addition_task and plan.spec.params <= ACCURACY_MAX_PARAMS
    if lead and scored and not plan.job.resume:
        phase("measuring held-out addition accuracy before training")
        before = addition_accuracy(plan.job.model, plan.job.seed)
    phase(f"starting {plan.world} {plan.job.backend} worker process(es)")
    results = launch(dataclasses.replace(plan.job, feed=feed), plan.world)
    if note is not None:
        note.close()
    if results is None:  # a torchrun rank other than 0
        return None
    interrupted = any(r.interrupted for r in results)
    low = next((r.low_memory for r in sorted(results, key=lambda r: r.rank) if r.low_memory), None)
    if interrupted and low is not None:  # the guard stopped the run, which saved no model at the stop
        plan = dataclasses.replace(plan, job=dataclasses.replace(plan.job, save_model=False))
    elif low is not None:
        print(f"warning: {low.what()} at the end of its last window; the run completed", file=sys.stderr)
    after = None
    if scored and not interrupted and plan.job.out and plan.job.save_model:
        phase("measuring held-out addition accuracy after training")
        after = addition_accuracy(plan.job.out, plan.job.seed, base=plan.job.model if plan.schedule.lora else None)
        if note is not None:
            note.close()
    trace_error = None
    if opts.trace:
        try:
            save_trace(plan, results, opts.trace)
        except OSError as exc:
            trace_error = f"--trace {opts.trace}: cannot write ({exc.strerror or exc}); the run itself is complete"
    report = summary(plan, results, before, after, trace_path=None if trace_error else opts.trace)
    print(report)
    if interrupted and low is not None:
        raise CapacityError(stop_line(low, plan.job.out))
    if trace_error:
        raise InputError(trace_error)
    return RunOutcome(plan=plan, results=results, before=before, after=after, report=report,
                      code=130 if interrupted else 0)


def addition_accuracy(model: str, seed: int, *, base: str | None = None) -> float:
    """Held-out addition accuracy of a whole model (a shipped name or a saved directory; with `base`, `model` is
    a peft adapter directory for it)."""
    import torch

    from ..data.addition import AdditionTask, task_accuracy
    from ..model.hf import build_model
    from ..save.lora_save import build_with_adapter, read_adapter_config

    stack = (build_model(model, seed=seed) if base is None
             else build_with_adapter(base, model, read_adapter_config(model)[0], seed=seed))
    with torch.no_grad():
        return task_accuracy(stack.logits, task=AdditionTask(seed=seed))
