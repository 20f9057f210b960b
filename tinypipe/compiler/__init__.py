"""The compiler: a Policy for a model on hardware -> a Schedule, and the static checks of a Schedule.

`compile.py` runs the passes (`compile_schedule`); `ops.py` holds the mutable ops they work on and
`lower`, which turns them into the schedule's actions; `passes.py` the list-to-list passes
(`optimizer.py` the optimizer's); `validate.py` the checks every schedule must pass (docs/schedule-contract.md).
"""

from tinypipe.compiler.compile import (
    PASSES,
    WINDOW_ITERATIONS,
    Op,
    compile_schedule,
    compute_ops,
    gradient_pass,
    lower,
    make_plan,
    memory_pass,
    optimizer_pass,
    run_passes,
    swap_pass,
    transfer_pass,
    window_steps,
)

__all__ = ["PASSES", "WINDOW_ITERATIONS", "Op", "compile_schedule", "compute_ops", "gradient_pass", "lower",
           "make_plan", "memory_pass", "optimizer_pass", "run_passes", "swap_pass", "transfer_pass",
           "window_steps"]
