"""OptimizerProfile: one layer's host optimizer step as `tinypipe profile` measured it (a trace's kind carries it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tinypipe.errors import InputError
from tinypipe.jsonio import Fields
from tinypipe.policy.modes import HOST_LAYOUTS


@dataclass(frozen=True)
class OptimizerProfile:
    """One host optimizer step (OPT_STEP) of a layer of one kind, measured by `tinypipe profile`
    (backends/profile/optim.py): `HostState.step` on the rank's optimizer thread at `threads` torch
    threads, median seconds per host layout, with nothing else running (`alone_s`) and while the
    main thread keeps the device busy as in a run (`in_run_s`, what the simulator charges), and the
    asynchronous optimizer's step in a run's conditions (`async_in_run_s`: the step that first keeps
    the version the next iteration's uploads still read)."""

    params: int  # parameters of the measured layer (its own: a tied LM head's norm only)
    threads: int
    alone_s: Mapping[str, float] = field(default_factory=dict)  # host layout -> s
    in_run_s: Mapping[str, float] = field(default_factory=dict)
    async_in_run_s: Mapping[str, float] = field(default_factory=dict)  # empty in traces before it

    def step_s(self, layout: str, params: int, *, asynchronous: bool = False) -> float | None:
        """The in-run step of a layer of `params` parameters under `layout` (`asynchronous`: the async
        optimizer's, where measured, else the sync one), scaled from the measured layer's in proportion
        (the same layer: exactly the measurement); None if `layout` was not measured."""
        t = self.async_in_run_s.get(layout) if asynchronous else None
        t = self.in_run_s.get(layout) if t is None else t
        return None if t is None else t * params / self.params

    def to_json(self) -> dict[str, Any]:
        out = {"params": self.params, "threads": self.threads, "alone_s": dict(self.alone_s),
               "in_run_s": dict(self.in_run_s)}
        if self.async_in_run_s:
            out["async_in_run_s"] = dict(self.async_in_run_s)
        return out

    @classmethod
    def from_json(cls, f: Fields) -> OptimizerProfile:
        def seconds(key: str) -> dict[str, float]:
            times = f.obj_(key, {})
            for layout in times.obj:
                if layout not in HOST_LAYOUTS:
                    raise InputError(f"{times.where}: unknown host layout {layout!r}; expected "
                                     f"{', '.join(HOST_LAYOUTS)}")
            return {layout: times.float(layout, positive=True) for layout in times.obj}

        return cls(params=f.int("params", minimum=1), threads=f.int("threads", minimum=1),
                   alone_s=seconds("alone_s"), in_run_s=seconds("in_run_s"),
                   async_in_run_s=seconds("async_in_run_s"))
