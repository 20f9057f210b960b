"""Compile and simulate one policy (the fit check); a Mobius partition is kept only if no uniform one with as many
packs beats it.

The Mobius MILP (`tinypipe.partition.mobius`) minimises a coarser objective than the simulator's and
stops at a 2% gap, and in some cases picked partitions 8-27% slower in the simulator than the plain
uniform ones with the same pack count (llama-3.1-8b on rtx3090x4-pcie3, 8 microbatches: 9.98 s against
7.84 s). A Mobius baseline is an honest peer only if its partition is at least as good as the simple
ones, so `simulate_policy` simulates those beside the MILP's pick and keeps the fastest that fits
(the MILP's on ties).

A policy fits when its GPU peak fits whatever the host optimizer's speed. Under the compact layout's gradient
ring a sync schedule's GRAD_OUT waits for an OPT_STEP of its own iteration, so a host slower than planned keeps
gradients on the GPU while the backward goes on (`slow_host_bound`); the async optimizer's own case is
`simulate`'s (sim/engine.py). Llama-3.1-8B on one H200 at 24 GiB, uniform 3, activations on the host, compact,
sync (evidence/h200-2026-12-05): the simulator at the planned host rate said 8.26 GiB, the run's ledger 13.30
(its host optimizer 2.6 x slower than calibrated); the bound is 16.7 (with the compiled blocks' profile, as `run`
plans; 17.7 with the eager one `simulate` takes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tinypipe.common.errors import TinypipeError
from tinypipe.compiler import compile_schedule
from tinypipe.describe.hardware import HOST, Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.trace import ProfileTrace
from tinypipe.ir.kinds import Kind
from tinypipe.ir.schedule import Schedule
from tinypipe.partition.mobius import same_count_uniform
from tinypipe.policy import Policy
from tinypipe.sim.engine import simulate, slow_host_memory
from tinypipe.sim.result import SimResult


def simulate_policy(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
                    iterations: int, gpu_mem_bytes: int | None = None,
                    host_mem_bytes: int | None = None, grad_clip: bool = False) -> tuple[Schedule, SimResult]:
    """`policy` compiled and simulated (capacities recorded, not raised); for `packing: mobius` the fastest
    of the MILP's partition and the uniform ones with its pack count. A policy that cannot compile raises."""
    def run(p: Policy) -> tuple[Schedule, SimResult]:
        return compile_and_simulate(p, model, hardware, trace, iterations=iterations, gpu_mem_bytes=gpu_mem_bytes,
                                    host_mem_bytes=host_mem_bytes, grad_clip=grad_clip)

    best = run(policy)
    for alt in alternatives(policy, tuple(len(p) for p in best[0].pack_layers)):
        try:
            cand = run(alt)
        except TinypipeError:
            continue
        if beats(cand[1], best[1]):
            best = cand
    return best


def compile_and_simulate(policy: Policy, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
                         iterations: int, gpu_mem_bytes: int | None = None, host_mem_bytes: int | None = None,
                         grad_clip: bool = False) -> tuple[Schedule, SimResult]:
    """`policy` alone compiled for the cap and simulated, capacities recorded; a schedule met before (`_SIMULATED`)
    is not simulated again."""
    sched = compile_schedule(policy, model, hardware, trace, iterations=iterations, grad_clip=grad_clip,
                             gpu_mem_bytes=gpu_mem_bytes)
    key = _Key(sched, (id(model), id(hardware), id(trace), gpu_mem_bytes, host_mem_bytes))
    hit = _SIMULATED.get(key)
    if hit is not None and hit[0] is model and hit[1] is hardware and hit[2] is trace:
        return sched, hit[3]
    res = simulate(sched, model, hardware, trace, gpu_mem_bytes=gpu_mem_bytes, host_mem_bytes=host_mem_bytes,
                   on_capacity="record")
    res = slow_host_bound(sched, model, hardware, trace, res)
    _SIMULATED[key] = (model, hardware, trace, res)
    if len(_SIMULATED) > SIMULATED_KEPT:
        _SIMULATED.pop(next(iter(_SIMULATED)))
    return sched, res


def gradients_wait_for_host(schedule: Schedule) -> bool:
    """Whether a GRAD_OUT of a sync schedule waits for an OPT_STEP of its own iteration (the compact layout's ring
    of host gradient slots): then its gradient stays on the GPU, and the backward goes on, at the host's pace."""
    if schedule.optimizer.is_async:
        return False
    acts = schedule.actions
    return any(acts[d].kind is Kind.OPT_STEP and acts[d].iteration == a.iteration
               for a in acts if a.kind is Kind.GRAD_OUT for d in a.deps)


def slow_host_bound(schedule: Schedule, model: ModelSpec, hardware: Hardware, trace: ProfileTrace,
                    res: SimResult) -> SimResult:
    """`res` (simulated at the planned host rate) with each GPU's peak the larger of its own and that of the same
    schedule run with every OPT_STEP slower than the whole run (`engine.slow_host_memory`), where
    `gradients_wait_for_host`; its fit judged on both. A bound over the host's speed: a sync run waits for every
    step before its next forward, so gradients pile up only within one backward, as in the slow run.
    tests/backends/test_memory_bound.py runs the CPU backend with a slow host under it."""
    if not gradients_wait_for_host(schedule):
        return res
    static = {d: schedule.static(d) for d in res.capacity_bytes}
    gpus_only = {d: b if d != HOST else max(b, 1 << 62) for d, b in res.capacity_bytes.items()}  # the host is res's
    slow = slow_host_memory(schedule, model, hardware, trace, gpus_only, static, "record", None, None,
                             res.timeline.end_s)
    got = slow.peaks()
    peaks = {d: b if d == HOST else max(b, got.get(d, 0)) for d, b in res.peak_bytes.items()}
    violation = res.violation or (None if slow.violation is None else (
        f"{slow.violation} (with the host optimizer slower than planned: under the compact layout's gradient ring "
        "the GPU keeps each gradient until a host slot is free)"))
    return dataclasses.replace(res, peak_bytes=peaks, violation=violation, fits=violation is None)


def alternatives(policy: Policy, sizes: tuple[int, ...]) -> list[Policy]:
    """What `simulate_policy` simulates beside `policy` once it compiled to packs of `sizes`: for `packing:
    mobius`, the uniform partitions with as many packs, in order (none for other packings)."""
    if policy.packing != "mobius":
        return []
    out = []
    for uniform in same_count_uniform(sum(sizes), len(sizes)):
        if uniform != sizes:
            try:
                out.append(policy.replace(packing=uniform))
            except TinypipeError:
                continue
    return out


def beats(cand: SimResult, best: SimResult) -> bool:
    """Whether the guard keeps `cand` over `best`: it fits where `best` does not, or as well and is faster
    (on ties, the one simulated first: the MILP's)."""
    return (not cand.fits, cand.iteration_s) < (not best.fits, best.iteration_s)


class _Key:
    """A schedule without its names, and what else the simulation reads (the ids of the model, hardware and
    trace, and the memory limits), as a dictionary key. Equal keys have equal schedules; the hash reads the
    schedule's header and a sample of its actions' dependencies only, since hashing every action (a
    dataclass hashed in Python, its memory effects too) took longer than compiling the schedule."""

    __slots__ = ("schedule", "inputs", "_hash")

    def __init__(self, schedule: Schedule, inputs: tuple[Any, ...]) -> None:
        self.schedule = dataclasses.replace(schedule, meta=())
        self.inputs = inputs
        acts = schedule.actions
        sample = tuple(a.deps for a in acts[::max(1, len(acts) // 64)])
        self._hash = hash((inputs, len(acts), schedule.pack_layers, schedule.pack_gpu, schedule.static_bytes,
                           schedule.iterations, schedule.microbatches, schedule.grad_clip, sample))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Key) and self._hash == other._hash and self.inputs == other.inputs
                and self.schedule == other.schedule)


# Policies a search tries often compile to the same schedule (one option apart that changes nothing here: on
# one GPU the mapping, swap by layer or by pack when packs hold one layer, ...): each is simulated once per
# process. The key holds the schedule without its names, and the model, hardware and trace objects' ids (the
# objects kept alive in the value, so an id is never reused while its entry stands).
SIMULATED_KEPT = 256
_SIMULATED: dict[_Key, tuple[ModelSpec, Hardware, ProfileTrace, SimResult]] = {}
