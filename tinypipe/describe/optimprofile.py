"""`OptimizerProfile`: one host optimizer step (OPT_STEP) of a layer kind as `tinypipe profile` measured it,
alone, beside the device's work, and by what the rank's compute stream runs meanwhile (`StepPhases`).

A `tinypipe.describe.trace.KindProfile` carries one (`optimizer`); `tinypipe.estimate.hostmem.optimizer_step_s` and
`optimizer_step_phases_s` are the rules that read it (backends/profile/optim.py measures it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields
from tinypipe.policy.modes import HostMemory


class StepPhases(NamedTuple):
    """One OPT_STEP's seconds by what its rank's main thread does while it runs, indexed by `Phase`."""

    idle_s: float  # the compute stream waits (the main thread polls and sleeps): the step alone
    beside_fwd_s: float  # the main thread issues FWDs back to back
    beside_bwd_s: float  # the main thread issues BWDs back to back


class Phase(IntEnum):
    """What a rank's compute stream runs: the index into `StepPhases`."""

    IDLE = 0
    FWD = 1
    BWD = 2


@dataclass(frozen=True)
class OptimizerProfile:
    """One host optimizer step (OPT_STEP) of a layer of one kind, measured by `tinypipe profile`
    (backends/profile/optim.py): `HostState.step` on the rank's optimizer thread at `threads` torch
    threads, median seconds per host memory layout, with nothing else running (`alone_s`) and while the
    main thread keeps the device busy as in a run (`in_run_s`, what the simulator charges), and the
    asynchronous optimizer's step in a run's conditions (`async_in_run_s`: the step that first keeps
    the version the next iteration's uploads still read).

    By phase (`phases_s`; empty in traces before them): the step while the main thread issues only
    FWDs (`beside_fwd_s`) or only BWDs (`beside_bwd_s`), and the asynchronous step alone and beside
    each (`async_*`). A step shares the host with the thread that issues the device's work (the GIL,
    the cores), and how much that thread does depends on what it issues: in the async Qwen3-1.7B run
    on an H200 (compiled, 4 x 2048; docs/fidelity.md) a block's step took 82 ms while the forward
    was issued, 65 ms beside the backward and 41 ms while the compute stream waited (means of the
    steps by the phase they overlapped most), where the one in-run figure (a loop of both) was 43 ms."""

    params: int  # parameters of the measured layer (its own: a tied LM head's norm only)
    threads: int
    alone_s: Mapping[str, float] = field(default_factory=dict)  # host memory layout -> s
    in_run_s: Mapping[str, float] = field(default_factory=dict)
    async_in_run_s: Mapping[str, float] = field(default_factory=dict)  # empty in traces before it
    async_alone_s: Mapping[str, float] = field(default_factory=dict)  # the phases' (empty before them)
    beside_fwd_s: Mapping[str, float] = field(default_factory=dict)
    beside_bwd_s: Mapping[str, float] = field(default_factory=dict)
    async_beside_fwd_s: Mapping[str, float] = field(default_factory=dict)
    async_beside_bwd_s: Mapping[str, float] = field(default_factory=dict)

    def step_s(self, host_memory: str, params: int, *, asynchronous: bool = False) -> float | None:
        """The in-run step of a layer of `params` parameters under `host_memory` (`asynchronous`: the async
        optimizer's, where measured, else the sync one), scaled from the measured layer's in proportion
        (the same layer: exactly the measurement); None if `host_memory` was not measured."""
        t = self.async_in_run_s.get(host_memory) if asynchronous else None
        t = self.in_run_s.get(host_memory) if t is None else t
        return None if t is None else t * params / self.params

    def phases_s(self, host_memory: str, params: int, *, asynchronous: bool = False) -> StepPhases | None:
        """The step of a layer of `params` parameters under `host_memory` by phase (alone, beside FWDs, beside
        BWDs; `asynchronous`: the async optimizer's), scaled as `step_s`; None unless all three were
        measured for that layout and mode."""
        got = ((self.async_alone_s, self.async_beside_fwd_s, self.async_beside_bwd_s) if asynchronous
               else (self.alone_s, self.beside_fwd_s, self.beside_bwd_s))
        times = [d.get(host_memory) for d in got]
        if any(t is None for t in times):
            return None
        return StepPhases(*(t * params / self.params for t in times if t is not None))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"params": self.params, "threads": self.threads, "alone_s": dict(self.alone_s),
                               "in_run_s": dict(self.in_run_s)}
        for key in OPTIONAL_STEP_KEYS:
            if getattr(self, key):
                out[key] = dict(getattr(self, key))
        return out

    @classmethod
    def from_json(cls, f: Fields) -> OptimizerProfile:
        def seconds(key: str) -> dict[str, float]:
            times = f.obj_(key, {})
            for host_memory in times.obj:
                if host_memory not in tuple(HostMemory):
                    raise InputError(f"{times.where}: unknown host memory layout {host_memory!r}; expected "
                                     f"{', '.join(tuple(HostMemory))}")
            return {host_memory: times.float(host_memory, positive=True) for host_memory in times.obj}

        return cls(params=f.int("params", minimum=1), threads=f.int("threads", minimum=1),
                   alone_s=seconds("alone_s"), in_run_s=seconds("in_run_s"),
                   **{key: seconds(key) for key in OPTIONAL_STEP_KEYS})


# OptimizerProfile's optional times (written only when measured)
OPTIONAL_STEP_KEYS = ("async_in_run_s", "async_alone_s", "beside_fwd_s", "beside_bwd_s", "async_beside_fwd_s",
                      "async_beside_bwd_s")
