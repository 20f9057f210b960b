"""The device kept busy as in a run, for timing host work beside it: one block's actions issued by the executor.

`DeviceLoop.run_until(done)` issues, window after window, one decoder block's actions through the
executor's own loop (`executor.run_actions`, from the calling thread): per cycle LOAD (h2d stream),
MICROBATCHES x FWD then the recomputing BWDs in reverse (compute stream), GRAD_OUT (d2h stream) and
EVICT. So the calling thread dispatches, polls its streams' events and sleeps between them exactly as
a rank's main thread does in `tinypipe run`, the device runs the block's kernels (compiled when the
profile compiles them) and the copies run on their own streams (between the cycles' compute: see
`cycle_actions`); on the CPU backend the same loop runs the work itself, as the CPU stand-in does in
a run. Host work timed meanwhile on another thread (the
optimizer's `HostWorker`) sees a run's contention: for the GIL, the host's cores and its memory
bandwidth (the copies' DMA).

Phases (`only`): a loop of FWDs only (LOAD, PHASE_MICROBATCHES x FWD, EVICT per window) or of BWDs only
(LOAD, PHASE_MICROBATCHES x recomputing BWD, GRAD_OUT, EVICT), each microbatch's input and output
gradient placed as before. The main thread's issue work differs between them (an FWD is shorter on the
device for about the same issue), and so does what a host step beside them loses to it: optim.py times
the step beside each, the simulator's phases (`tinypipe.describe.trace.StepPhases`). One upload per window of 16,
so that the loop is the phase and seldom waits for a copy (the forward of the async H200 runs issued all
its microbatches through resident layers).

Why the block, whichever layer's host work is timed: in a run every layer's optimizer step overlaps
the blocks' compute (a block is most of the device's work), and a loop of the embedding or the LM
head would be mostly their 1 GB uploads and downloads (Llama-3.1-8B), a DMA load no run puts beside
a step. Why MICROBATCHES per upload: a run uploads a layer once or twice per iteration and runs all
its microbatches through it (the H200 runs: 8 or 16 of them per upload pair), so its copies use a
fraction of the compute's span; 4 puts the loop's copies near that fraction (a Llama-3.1-8B block at
4 x 2048 tokens: ~0.9 GB of copies per ~100 ms of compute) without knowing the run's policy.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count
from typing import Literal

import torch

from tinypipe.describe.model import LayerKind
from tinypipe.ir.schedule import Action, Kind, gpu_resource
from tinypipe.policy.modes import HostMemory

from ..host.layouts import make_host_state
from ..host.state import AdamWConfig
from ..rank.executor import RunLog, run_actions
from ..rank.interpreter import Interpreter, StepData
from .measure_layers import STEP, LayerBench

MICROBATCHES = 4  # FWD / BWD per LOAD + GRAD_OUT (module docstring)
CYCLES = 2  # per window: a window ends with the streams synchronised, as a run's window does
Only = Literal["fwd", "bwd"] | None  # a loop of FWDs only or BWDs only (module docstring), or both
PHASE_MICROBATCHES = 16  # FWD / BWD per window (and per LOAD) of a loop of one phase (module docstring)


def cycle_actions(layer: int, *, microbatches: int = MICROBATCHES, cycles: int = CYCLES, only: Only = None
                  ) -> list[Action]:
    """One window: `cycles` x (LOAD, FWD m.., BWD ..m, GRAD_OUT, EVICT) of `layer`, microbatches numbered on
    across cycles. A LOAD waits for the previous cycle's EVICT: the interpreter holds one set of weights
    per layer, so the next upload of the same layer must not replace the set its BWDs still read (in a
    run the upload overlapping a layer's compute is the next layer's); GRAD_OUT waits for the last BWD.
    `only="fwd"`: no BWD and no GRAD_OUT; `only="bwd"`: no FWD, and the BWDs wait for the LOAD."""
    ids = count()
    compute, h2d, d2h = (gpu_resource(0, s) for s in ("compute", "h2d", "d2h"))
    out: list[Action] = []
    evicts: list[int] = []

    def add(kind: Kind, resource: str, deps: tuple[int, ...] = (), microbatch: int | None = None) -> int:
        a = Action(next(ids), kind, resource, layer=layer, microbatch=microbatch, deps=deps)
        out.append(a)
        return a.id

    for c in range(cycles):
        mbs = range(c * microbatches, (c + 1) * microbatches)
        load = add(Kind.LOAD, h2d, (evicts[-1],) if evicts else ())
        if only != "bwd":
            for m in mbs:
                add(Kind.FWD, compute, (load,), m)
        if only != "fwd":
            last = 0
            for m in reversed(mbs):
                last = add(Kind.BWD, compute, (load,) if only == "bwd" else (), m)
            add(Kind.GRAD_OUT, d2h, (last,))
        evicts.append(add(Kind.EVICT, compute))
    return out


class DeviceLoop:
    """One block of `bench` run through the executor, window after window (module docstring)."""

    def __init__(self, bench: LayerBench, *, microbatch_size: int, seq_len: int, seed: int = 0, only: Only = None
                 ) -> None:
        self.layer = L = bench.layers[LayerKind.BLOCK.value]
        self.only = only
        # The block's weights in a host state of their own, pinned on CUDA as a run's are, so that LOAD and
        # GRAD_OUT are asynchronous copies on their streams (the profile's own state is pageable). Its layout
        # is the replicated one: its gradient buffer takes GRAD_OUT after GRAD_OUT, where the compact ring
        # wants an OPT_STEP between two; so the downloads are fp32, twice a compact run's bytes.
        host = make_host_state({L: bench.host.master(L)}, host_memory=HostMemory.REPLICATED, compute_dtype=bench.dtype,
                               optim=AdamWConfig(), pin=bench.device.type == "cuda")
        like = bench.interp[True]  # the recomputing schedule's interpreter, as the presets run
        self.it = Interpreter(rank=0, schedule=like.schedule, layers=like.layers, host=host, comm=None,
                              device=bench.device, hidden_size=bench.spec.hidden_size, caller=like.caller)
        per, cycles = (MICROBATCHES, CYCLES) if only is None else (PHASE_MICROBATCHES, 1)
        self.actions = cycle_actions(self.layer, microbatches=per, cycles=cycles, only=only)
        n = cycles * per
        gen = torch.Generator().manual_seed(seed)
        shape = (microbatch_size, seq_len)
        ids = torch.randint(bench.spec.vocab_size, shape, generator=gen)
        self.data = {STEP: StepData(microbatches=[(ids, ids)] * n, denom=float(ids.numel()))}
        hidden = (*shape, bench.spec.hidden_size)
        self.x = torch.randn(hidden, generator=gen).to(bench.device, bench.dtype)
        self.dy = torch.randn(hidden, generator=gen).to(bench.device, bench.dtype)
        self.n = n
        self.tokens = ids.numel()

    def window(self) -> RunLog:
        """One window: every microbatch's input and output gradient placed as a RECV would, the actions
        run, and what they hand on (the outputs, the input gradients) dropped as a SEND would. Returns
        the executor's log (each action's record: looptimes.py times the FWDs and BWDs)."""
        it, L = self.it, self.layer
        for m in range(self.n):
            it.x[(STEP, L, m)] = self.x
            it.dx[(STEP, L + 1, m)] = self.dy
        log = run_actions(it, self.actions, self.data)
        for m in range(self.n):  # what the actions made, and what a loop of one phase left unused
            for key in ((STEP, L, m), (STEP, L + 1, m)):
                it.x.pop(key, None)
                it.dx.pop(key, None)
        it.data = {}
        return log

    def run_until(self, done: Callable[[], bool], *, started: Callable[[], None] = lambda: None) -> int:
        """Run windows until `done()` (checked between windows; at least one); `started()` is called
        just before the first. Returns the windows run."""
        windows = 0
        started()
        while True:
            self.window()
            windows += 1
            if done():
                return windows

    @property
    def describe(self) -> str:
        work = {None: f"{CYCLES} x (LOAD, {MICROBATCHES} x FWD, {MICROBATCHES} x recomputing BWD, GRAD_OUT, EVICT)",
                "fwd": f"LOAD, {PHASE_MICROBATCHES} x FWD, EVICT",
                "bwd": f"LOAD, {PHASE_MICROBATCHES} x recomputing BWD, GRAD_OUT, EVICT"}[self.only]
        return (f"layer {self.layer} (a block) at {self.tokens} tokens per microbatch, {work} per window, issued by "
                f"the executor (`run_actions`) from the main thread")
