"""Held-out evaluation through the pipeline: the schedule's first iteration run on held-out batches, no update.

An evaluation window is one iteration of the compiled schedule, its actions as in training (the same
uploads, forwards, backwards and transfers, so the same memory plan holds), run with
`Interpreter.evaluating` set: GRAD_OUT drops the gradients and OPT_STEP does nothing, so the host
state is untouched and the head's forward gives the loss. It costs a training step's device work per
held-out step, without the optimizer. The weights are those after the last optimizer step: the caller
finishes the host's steps first, and the window runs as the step whose uploads read that version (the
next step under the synchronous optimizer, the one after it under the asynchronous one, whose uploads lag
an update). LoRA: the adapters' gradients are dropped at ADAPT_STEP, and no step is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Action

from ..data.batches import Batches
from .executor import run_actions
from .hostwork import HostWorker
from .interpreter import ExecutionError, Interpreter, StepData

EVAL_SPAN = "held-out evaluation"  # the host span (RankResult.host) of an evaluation, left out of the run's speed


def eval_steps(batches: Batches) -> int:
    """Whole held-out steps in `batches`' source (its sequences in steps of microbatches x microbatch_size)."""
    return len(batches.source) // (batches.microbatches * batches.microbatch_size)  # type: ignore[arg-type]


def evaluate(interp: Interpreter, first_iteration: Sequence[Action], batches: Batches, steps: int, *, at: int,
             step_data: Callable[[Batches, int], StepData], id_stride: int, host_worker: HostWorker) -> float | None:
    """The token-weighted mean loss over `steps` held-out steps with the weights after `at` optimizer steps
    (all of them finished on the host), each run as the training step that reads those weights; on the rank
    that holds the head (None on the others)."""
    total, tokens = 0.0, 0.0
    as_step = at + interp.staleness  # want_version(as_step) == at
    interp.evaluating = True
    try:
        for k in range(steps):
            sd = step_data(batches, k)
            log = run_actions(interp, first_iteration, {as_step: sd}, shift=as_step,
                              ledger=Ledger(interp.schedule.static_bytes, buffers=True), id_stride=id_stride,
                              host_worker=host_worker)
            left = interp.leftovers()
            if left:
                raise ExecutionError(f"rank {interp.rank}: evaluation at step {at} ended holding {', '.join(left[:6])}")
            if as_step in log.losses:
                total += log.losses[as_step] * sd.denom
                tokens += sd.denom
    finally:
        interp.evaluating = False
    return total / tokens if tokens else None
