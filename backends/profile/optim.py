"""One host optimizer step (OPT_STEP) of each layer kind, timed alone and beside the device's work.

Each kind's result is a `tinypipe.describe.optimprofile.OptimizerProfile`, which its trace carries.

The simulator used to cost every OPT_STEP at one rate per host memory layout, measured on one large tensor
with nothing else running. On the H200 host that rate (compact: 1.75 G params/s) was too fast twice
over: inside a run the same step ran at 1.55 G params/s (beside GPU dispatch, copies and the
executor's polling loop), and Qwen3-1.7B's smaller tensors stepped at 1.1-1.4 G params/s. So per
layer kind (embedding, block, head: their real tensors) and per host memory layout:

- the host state is the run's own (`layouts.make_host_state`: the layer's fp32 masters in the
  layout's slab, one gradient slot), and the step is `HostState.step`, what an
  OPT_STEP runs, on a `HostWorker` thread as in a run, at `threads` torch intra-op threads (the
  count a rank of `tinypipe run` gets). Before each step the worker delivers the gradients as
  GRAD_OUT does (`receive_grads`, in the compute dtype; a tied embedding gets both shares, and its
  step adds the second, as in a run); the delivery is not timed, as a run's OPT_STEP record does not
  hold it. One untimed warm-up step allocates the AdamW moments and says how long a step takes;
  then `steps_for` picks how many to time (fewer for big layers: OPT_BUDGET_S of steps, at least
  MIN_STEPS, at most the profile's repeat), and the median is kept.
- alone_s: the steps with the main thread waiting (nothing else running);
- in_run_s: the same number of steps while the main thread keeps the device busy through the
  executor (`devloop.DeviceLoop`); the first step starts once the loop has started. This is what the
  simulator charges (`tinypipe.estimate.hostmem.optimizer_step_s`).
- async_in_run_s: as in_run_s, the asynchronous optimizer's step: a host state with the layout's
  previous-version room (compact: the snapshot regions), each step keeping the previous version as
  an async run's do (`HostState.step(keep_previous=True)`), after one untimed warm-up step of its own.
- by phase, when given a loop of FWDs only and one of BWDs only (devloop.py, `only`): beside_fwd_s and
  beside_bwd_s, the sync step beside each, and async_alone_s, async_beside_fwd_s, async_beside_bwd_s the
  async step alone and beside each (`tinypipe.describe.trace.StepPhases`, which the simulator charges by what its
  rank's compute stream runs). Why: a step shares the host with the thread that issues the device's work,
  and that thread's share depends on what it issues. In the async Qwen3-1.7B run on an H200 (compiled, 4
  x 2048; docs/fidelity.md) a block's step took ~82 ms while the forward was issued, ~65 ms beside the
  backward and ~41 ms while the compute stream waited for a gradient, against the one 43 ms that a loop
  of both gave; the steps during the forward were on the critical path.

The slab is not page-locked: a run's is (`cudaHostRegister` on the same private mapping), which
changes what the copy engines may do with it, not what the CPU does, and registering the 3 GB of
an 8B model's embedding takes about a second.

Not measured: other ranks stepping at the same time (a run of N GPUs has N optimizer
threads sharing the host's memory bandwidth; profile with `--threads` at the per-rank count of that
run to have each rank's share of the cores).
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tinypipe.describe.model import LayerKind
from tinypipe.describe.optimprofile import OptimizerProfile
from tinypipe.policy.modes import HostMemory

from ..host.layouts import make_host_state
from ..host.state import AdamWConfig, HostState
from ..rank.cpustat import NOTABLE_STEAL, Steal
from ..rank.hostwork import HostWorker
from .devloop import DeviceLoop
from .measure_layers import LayerBench

# OptimizerProfile's fields by phase, as KindSteps.phases_s names them
PHASE_FIELDS = ("beside_fwd_s", "beside_bwd_s", "async_alone_s", "async_beside_fwd_s", "async_beside_bwd_s")
OPT_BUDGET_S = 1.0  # seconds of timed steps per kind, host memory layout and condition (alone / in the run)
MIN_STEPS = 3  # a median of at least this many, whatever their length (unless the profile's repeat is lower)


def steps_for(warm_s: float, max_steps: int) -> int:
    """How many steps to time after a warm-up step of `warm_s`: OPT_BUDGET_S of them, at least MIN_STEPS,
    at most `max_steps` (and never more than `max_steps`, even below MIN_STEPS)."""
    fit = int(OPT_BUDGET_S / warm_s) if warm_s > 0 else max_steps
    return max(1, min(max_steps, max(MIN_STEPS, fit)))


@dataclass(frozen=True)
class KindSteps:
    """The timed steps of one layer kind under one host memory layout, seconds each."""

    params: int
    warm_s: float
    alone_s: tuple[float, ...]
    in_run_s: tuple[float, ...]
    async_in_run_s: tuple[float, ...]
    # by phase (module docstring): OptimizerProfile's field -> the timed steps (empty without the phases' loops)
    phases_s: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def joined(self, other: KindSteps) -> KindSteps:
        """These steps and another round's (this round's warm-up kept)."""
        return KindSteps(params=self.params, warm_s=self.warm_s, alone_s=self.alone_s + other.alone_s,
                         in_run_s=self.in_run_s + other.in_run_s,
                         async_in_run_s=self.async_in_run_s + other.async_in_run_s,
                         phases_s={k: self.phases_s.get(k, ()) + other.phases_s.get(k, ())
                                   for k in {*self.phases_s, *other.phases_s}})


class Stepper:
    """One layer's host state under one host memory layout, and its gradients, stepped on a `HostWorker`."""

    def __init__(self, masters: dict[str, torch.Tensor], *, layer: int, host_memory: HostMemory, dtype: torch.dtype,
                 tied: str | None, keep_previous: bool = False) -> None:
        self.layer = layer
        self.keep_previous = keep_previous  # the asynchronous optimizer's step
        self.state: HostState = make_host_state({layer: masters}, host_memory=host_memory, compute_dtype=dtype,
                                                optim=AdamWConfig(), grad_ring_slots=1,
                                                shared_grad=layer if tied is not None else None,
                                                snapshots=keep_previous)
        # AdamW's time does not depend on the values (elementwise, no branches): a constant gradient costs
        # what a real one does, and filling 525M of them takes milliseconds where drawing them takes seconds
        self.grads = {n: torch.full(t.shape, 1e-3, dtype=dtype) for n, t in masters.items()}
        # a tied embedding's step adds the head's share of the matrix (its second GRAD_OUT share)
        self.second = {tied: self.grads[tied].clone()} if tied is not None else None
        self.worker = HostWorker(name="profile-optim")

    def deliver(self) -> None:
        """What GRAD_OUT does before each OPT_STEP (both shares for a tied embedding)."""
        self.state.receive_grads(self.layer, self.grads)
        if self.second is not None:
            self.state.receive_grads(self.layer, self.second)

    def submit(self, before: Callable[[], object] = lambda: None) -> Future[tuple[float, float]]:
        """Queue one step, after `before()` and the delivery; the future holds its (start, end)."""
        def gated() -> None:
            before()
            self.deliver()

        return self.worker.submit(gated, lambda: self.state.step(self.layer, keep_previous=self.keep_previous))

    def close(self) -> None:
        self.worker.close()


def _seconds(fut: Future[tuple[float, float]]) -> float:
    t0, t1 = fut.result()
    return t1 - t0


def time_steps(bench: LayerBench, kind: str, host_memory: HostMemory, loop: DeviceLoop, *, max_steps: int,
               phases: Mapping[str, DeviceLoop] | None = None) -> KindSteps:
    """Time `kind`'s OPT_STEP under `host_memory`: a warm-up, then alone, then beside `loop` (module docstring);
    with `phases` (a loop of FWDs only under "fwd", of BWDs only under "bwd") also beside each of them, and
    the async step alone and beside each. The caller sets the torch thread count (the rank's)."""
    layer = bench.layers[kind]
    tied = bench.tied[1] if bench.tied is not None and kind == LayerKind.EMBED.value else None

    def in_run(s: Stepper, n: int, beside: DeviceLoop) -> tuple[float, ...]:
        go = threading.Event()
        try:
            futs = [s.submit(go.wait)] + [s.submit() for _ in range(n - 1)]
            beside.run_until(futs[-1].done, started=go.set)
        finally:
            go.set()  # a loop that failed before starting must not leave the worker waiting
        return tuple(_seconds(f) for f in futs)

    by_phase: dict[str, tuple[float, ...]] = {}
    s = Stepper(bench.host.master(layer), layer=layer, host_memory=host_memory, dtype=bench.dtype, tied=tied)
    try:
        warm = _seconds(s.submit())
        n = steps_for(warm, max_steps)
        alone = tuple(_seconds(s.submit()) for _ in range(n))
        synced = in_run(s, n, loop)
        for phase, beside in (phases or {}).items():
            by_phase[f"beside_{phase}_s"] = in_run(s, n, beside)
    finally:
        s.close()
    a = Stepper(bench.host.master(layer), layer=layer, host_memory=host_memory, dtype=bench.dtype, tied=tied,
                 keep_previous=True)
    try:
        _seconds(a.submit())  # its own warm-up: the moments, and the first touch of the kept copy
        kept = in_run(a, n, loop)
        if phases:
            by_phase["async_alone_s"] = tuple(_seconds(a.submit()) for _ in range(n))
        for phase, beside in (phases or {}).items():
            by_phase[f"async_beside_{phase}_s"] = in_run(a, n, beside)
    finally:
        a.close()
    return KindSteps(params=s.state.params, warm_s=warm, alone_s=alone, in_run_s=synced, async_in_run_s=kept,
                     phases_s=by_phase)


def measure_optimizer(bench: LayerBench, loop: DeviceLoop, *, threads: int, max_steps: int, rounds: int = 1,
                      say: Callable[[str], None] = lambda text: None, phases: Mapping[str, DeviceLoop] | None = None,
                      ) -> tuple[dict[str, OptimizerProfile], dict[str, dict[str, KindSteps]], list[float | None]]:
    """Per layer kind, its `OptimizerProfile` (medians per host memory layout), the timed steps the medians are over
    (kind -> host_memory -> KindSteps) and the host's stolen CPU share in each round taken (`cpustat.Steal`), at
    `threads` torch intra-op threads; with `phases` (`time_steps`) the steps by phase too. Every kind and
    host_memory is timed in each of `rounds` rounds, one after another, and the medians are over all rounds'
    steps: on virtual machines host steps can run 2x slow for tens of seconds at a time (cpustat), and one
    round's steps all fall inside such a spell. A round during which the hypervisor took more than
    NOTABLE_STEAL of the host's CPU is taken again, up to `rounds` more, and left out of the medians
    (`quiet_rounds`), unless no round was quiet: on virtual H200 machines a block's host step tracked
    the steal of the moment (correlation +0.84 over one machine's iterations), and a
    profile timed under 1-2.6% steal put the replicated block's in-run step at 23.7 ms against a quiet
    profile's 20.3."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    taken: list[tuple[dict[str, dict[str, KindSteps]], float | None]] = []
    try:
        for warm in (loop, *(phases or {}).values()):
            warm.window()  # warm-up: the loop's streams, its first allocations, a compiled block's graphs
        while sum(quiet(x) for _, x in taken) < rounds and len(taken) < 2 * rounds:
            meter = Steal()
            got: dict[str, dict[str, KindSteps]] = {}
            for kind in (k.value for k in LayerKind):
                for host_memory in tuple(HostMemory):
                    say(f"timing the {kind}'s host optimizer step ({host_memory}, {threads} thread(s)) alone and "
                        "beside "
                        f"the device's work" + (" (and by phase)" if phases else "")
                        + (f", round {len(taken) + 1} (of {rounds}, and one more for each round under "
                           "steal)" if rounds > 1 else ""))
                    got.setdefault(kind, {})[host_memory] = time_steps(bench, kind, host_memory, loop,
                                                                       max_steps=max_steps, phases=phases)
            taken.append((got, meter.share()))
    finally:
        torch.set_num_threads(before)
    steal = [s for _, s in taken]
    keep = set(quiet_rounds(steal))
    steps: dict[str, dict[str, KindSteps]] = {}
    for r, (got, _) in enumerate(taken):
        if r in keep:
            for kind, by in got.items():
                for lay, k in by.items():
                    had = steps.setdefault(kind, {}).get(lay)
                    steps[kind][lay] = k if had is None else had.joined(k)
    med = statistics.median
    out = {kind: OptimizerProfile(params=next(iter(by.values())).params, threads=threads,
                                  alone_s={lay: med(k.alone_s) for lay, k in by.items()},
                                  in_run_s={lay: med(k.in_run_s) for lay, k in by.items()},
                                  async_in_run_s={lay: med(k.async_in_run_s) for lay, k in by.items()},
                                  **{key: {lay: med(k.phases_s[key]) for lay, k in by.items() if k.phases_s.get(key)}
                                     for key in PHASE_FIELDS})
           for kind, by in steps.items()}
    return out, steps, steal


def quiet(steal: float | None) -> bool:
    """A round the hypervisor took at most NOTABLE_STEAL of the host's CPU in (or an unknown share: no
    /proc/stat)."""
    return steal is None or steal <= NOTABLE_STEAL


def quiet_rounds(steal: list[float | None]) -> list[int]:
    """The rounds whose steps count: the quiet ones, else, if none was, all of them."""
    return [r for r, x in enumerate(steal) if quiet(x)] or list(range(len(steal)))


def describe(threads: int, steps: dict[str, dict[str, KindSteps]], loop: DeviceLoop,
             phases: Mapping[str, DeviceLoop] | None = None) -> str:
    """What the traces' `source` says about the optimizer's profile: how it was measured, and the step counts."""
    counts = "; ".join(f"{kind} {', '.join(f'{lay} {len(k.alone_s)}' for lay, k in by.items())}"
                       for kind, by in steps.items())
    by_phase = "".join(f"; beside_{p}_s and async_beside_{p}_s while it ran {x.describe}"
                       for p, x in (phases or {}).items())
    return (f"one OPT_STEP of each kind's layer (`HostState.step` under each host memory layout, its own tensors, the "
            f"gradients delivered first and not timed) on a host-worker thread at {threads} torch thread(s), median "
            f"of N after one warm-up step (N: {counts}); alone_s with nothing else running, in_run_s (what the "
            f"simulator charges without the phases) while the main thread ran {loop.describe}"
            + (f"; by phase (what the simulator charges by what the rank's compute stream runs): async_alone_s "
               f"alone{by_phase}" if by_phase else ""))
