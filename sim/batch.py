"""Several policies through the Mobius guard (`simulate_policy`) at once, over worker processes.

`tinypipe simulate` compares policies that do not depend on each other, and the guard simulates a Mobius
pick's uniform partitions beside it: each of those is a task here, the guard's started as soon as the MILP's
pack count is known, so that the cores share them (the MILPs start first: each takes its whole time limit
when it cannot close its gap). What each policy gets is what `simulate_policy` gives it one policy after the
other; a policy that cannot compile raises, the first in the policies' order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from tinypipe.common.errors import TinypipeError
from tinypipe.describe.hardware import Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import ProfileTrace
from tinypipe.ir.schedule import Schedule
from tinypipe.ir.timeline import Timeline
from tinypipe.policy import Policy
from tinypipe.sim.guard import alternatives, beats, compile_and_simulate, simulate_policy
from tinypipe.sim.result import SimResult

Outcome = tuple[tuple[int, ...], SimResult]  # the layers of each pack, and the simulation


@dataclass(frozen=True)
class Task:
    """One policy on one workload. `timeline`: keep the result's timeline (it is large to send between
    processes; the others come back with an empty one)."""

    policy: Policy
    model: ModelSpec
    hardware: Hardware
    trace: ProfileTrace
    iterations: int
    gpu_mem_bytes: int | None = None
    host_mem_bytes: int | None = None
    timeline: bool = False


def simulate_policies(tasks: Sequence[Task], *, workers: int = 1) -> list[Outcome]:
    """`simulate_policy` of each task, in order, in up to `workers` processes (1: here, one after the other)."""
    if workers <= 1 or not tasks or (len(tasks) == 1 and tasks[0].policy.packing != "mobius"):
        return [_slim(t, _sizes_and_result(*simulate_policy(
            t.policy, t.model, t.hardware, t.trace, iterations=t.iterations, gpu_mem_bytes=t.gpu_mem_bytes,
            host_mem_bytes=t.host_mem_bytes))) for t in tasks]
    first: dict[int, Future[Outcome]] = {}
    beside: dict[int, list[Future[Outcome | None]]] = {}
    pool = ProcessPoolExecutor(max_workers=workers)
    try:
        for i in sorted(range(len(tasks)), key=lambda i: tasks[i].policy.packing != "mobius"):
            first[i] = pool.submit(run_task, tasks[i])
        mobius = {first[i]: i for i, t in enumerate(tasks) if t.policy.packing == "mobius"}
        for done in as_completed(mobius):
            i = mobius[done]
            if done.exception() is None:
                beside[i] = [pool.submit(_try_task, tasks[i], alt) for alt in alternatives(tasks[i].policy,
                                                                                         done.result()[0])]
        out = []
        for i in range(len(tasks)):
            best = first[i].result()
            for f in beside.get(i, []):
                cand = f.result()
                if cand is not None and beats(cand[1], best[1]):
                    best = cand
            out.append(best)
    finally:
        pool.shutdown(cancel_futures=True)
    return out


def run_task(task: Task, policy: Policy | None = None) -> Outcome:
    """Compile and simulate `policy` (the task's own when None) on the task's workload, capacities recorded."""
    return _slim(task, _sizes_and_result(*compile_and_simulate(
        policy or task.policy, task.model, task.hardware, task.trace, iterations=task.iterations,
        gpu_mem_bytes=task.gpu_mem_bytes, host_mem_bytes=task.host_mem_bytes)))


def _try_task(task: Task, policy: Policy) -> Outcome | None:
    """`run_task`, or None where the policy cannot compile (the guard passes over such a partition)."""
    try:
        return run_task(task, policy)
    except TinypipeError:
        return None


def _sizes_and_result(sched: Schedule, res: SimResult) -> Outcome:
    return tuple(len(p) for p in sched.pack_layers), res


def _slim(task: Task, outcome: Outcome) -> Outcome:
    sizes, res = outcome
    return sizes, (res if task.timeline else dataclasses.replace(res, timeline=Timeline(())))
