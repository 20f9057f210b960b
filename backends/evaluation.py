"""Held-out evaluation through the pipeline: the schedule's first iteration run on held-out batches, no update.

An evaluation window is one iteration of the compiled schedule, its actions as in training (the same
uploads, forwards, backwards and transfers, so the same memory plan holds), run with
`Interpreter.evaluating` set: GRAD_OUT drops the gradients and OPT_STEP does nothing, so the host
state is untouched and the head's forward gives the loss. It costs a training step's device work per
held-out step, without the optimizer. The weights are those after the last optimizer step (a
synchronous optimizer; the planner refuses evaluation with the asynchronous one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Action

from .data.batches import Batches
from .executor import run_actions
from .hostwork import HostWorker
from .interpreter import ExecutionError, Interpreter, StepData


def eval_steps(batches: Batches) -> int:
    """Whole held-out steps in `batches`' source (its sequences in steps of microbatches x microbatch_size)."""
    return len(batches.source) // (batches.microbatches * batches.microbatch_size)  # type: ignore[arg-type]


def evaluate(interp: Interpreter, first_iteration: Sequence[Action], batches: Batches, steps: int, *, at: int,
             step_data: Callable[[Batches, int], StepData], id_stride: int, host_worker: HostWorker) -> float | None:
    """The token-weighted mean loss over `steps` held-out steps, run as the training step `at` would
    run; on the rank that holds the head (None on the others)."""
    total, tokens = 0.0, 0.0
    interp.evaluating = True
    try:
        for k in range(steps):
            sd = step_data(batches, k)
            log = run_actions(interp, first_iteration, {at: sd}, shift=at, ledger=Ledger(interp.schedule.static_bytes,
                                                                                          buffers=True),
                              id_stride=id_stride, host_worker=host_worker)
            left = interp.leftovers()
            if left:
                raise ExecutionError(f"rank {interp.rank}: evaluation at step {at} ended holding {', '.join(left[:6])}")
            if at in log.losses:
                total += log.losses[at] * sd.denom
                tokens += sd.denom
    finally:
        interp.evaluating = False
    return total / tokens if tokens else None
