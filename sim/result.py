"""SimResult: what a simulation says — steady-state iteration time, throughput, memory, utilisation, critical path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tinypipe.common.units import GIB
from tinypipe.describe.hardware import HOST
from tinypipe.ir.kinds import Kind
from tinypipe.ir.order import predecessors
from tinypipe.ir.schedule import Schedule
from tinypipe.ir.timeline import Timeline, resource_sort_key, steady_state


@dataclass(frozen=True)
class CriticalPath:
    """The chain of actions that set the run's length, walked back from the last action to end.

    Each step goes to whichever predecessor (`tinypipe.ir.order.predecessors`) finished last: the previous
    action on the resource, a dependency, or — for a SEND / RECV — a predecessor of its other half (the
    copy waits for both).
    The time from that predecessor's end to the action's end is charged to the action's resource
    and kind, so the shares add up to 1 (of the whole run, all iterations).
    """

    actions: tuple[int, ...]  # ids, first to last
    by_resource: dict[str, float]  # share of the run
    by_kind: dict[str, float]

    @property
    def bottleneck(self) -> str:
        """The resource with the largest share ("" for an empty run)."""
        return max(self.by_resource, key=lambda r: self.by_resource[r], default="")


def critical_path(schedule: Schedule, timeline: Timeline, partner: dict[int, int],
                  lanes: Mapping[str, Sequence[int]] | None = None) -> CriticalPath:
    """Walk back from the last action to end through the predecessor that finished last (on its lane:
    `lanes` as the simulation ran them, else the resources' lists)."""
    acts = schedule.actions
    if not acts:
        return CriticalPath((), {}, {})
    end = [0.0] * len(acts)
    for r in timeline.records:
        end[r.id] = r.end_s
    t0 = timeline.start_s
    preds = predecessors(acts, partner=partner, lanes=lanes)
    cur = max(range(len(acts)), key=lambda i: (end[i], i))
    path: list[int] = []
    by_res: dict[str, float] = {}
    by_kind: dict[Kind, float] = {}  # by the kind itself (its printed name, an enum property, is slow to read)
    seen: set[int] = set()
    while cur not in seen:
        seen.add(cur)
        path.append(cur)
        cands = preds[cur]
        best = max(cands, key=lambda i: (end[i], i)) if cands else -1
        since = end[best] if best >= 0 else t0
        act = acts[cur]
        by_res[act.resource] = by_res.get(act.resource, 0.0) + end[cur] - since
        by_kind[act.kind] = by_kind.get(act.kind, 0.0) + end[cur] - since
        if best < 0:
            break
        cur = best
    total = max(end) - t0
    norm = (lambda x: x / total) if total > 0 else (lambda x: 0.0)
    return CriticalPath(tuple(reversed(path)),
                        {r: norm(by_res[r]) for r in sorted(by_res, key=resource_sort_key)},
                        {k.value: norm(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])})


TABLE_COLUMNS = ("iteration_s", "tokens_per_s", "peak_gpu_gib", "peak_host_gib", "host_bytes_per_param",
                 "fits", "bottleneck")


@dataclass(frozen=True)
class SimResult:
    """The outcome of one simulation. Times in seconds, memory in bytes, shares as fractions 0..1."""

    iteration_s: float  # steady state: mean of the iterations after the first (or the only one)
    tokens_per_s: float  # tokens per iteration / iteration_s
    iteration_times_s: tuple[float, ...]
    makespan_s: float  # all iterations
    tokens_per_iteration: int
    params: int  # model parameters, for bytes per parameter
    peak_bytes: dict[str, int]  # per device: g0, ..., host
    capacity_bytes: dict[str, int]
    # per resource: time in actions / makespan, per lane where it has several (`host.optim`: one per
    # rank); a SEND / RECV half counts from when its stream reached it, so the wait for its other half
    # counts too (the stream is blocked meanwhile)
    busy_fraction: dict[str, float]
    link_bytes: dict[str, int]  # per directed edge `u->v`, and `host.dma` for all host<->GPU copies
    critical_path: CriticalPath
    fits: bool
    violation: str | None  # the first capacity violation (on_capacity="record")
    events: int  # SimPy events scheduled
    wall_s: float  # time the simulation took
    timeline: Timeline = field(repr=False, compare=False)

    @property
    def peak_gpu_bytes(self) -> int:
        return max((b for d, b in self.peak_bytes.items() if d != HOST), default=0)

    @property
    def peak_host_bytes(self) -> int:
        return self.peak_bytes.get(HOST, 0)

    @property
    def host_bytes_per_param(self) -> float:
        """Peak host memory over the model's parameter count."""
        return self.peak_host_bytes / self.params if self.params else 0.0

    def table_row(self) -> dict[str, Any]:
        """One row for a results table, keyed by TABLE_COLUMNS (numbers unformatted)."""
        return {"iteration_s": self.iteration_s, "tokens_per_s": self.tokens_per_s,
                "peak_gpu_gib": self.peak_gpu_bytes / GIB, "peak_host_gib": self.peak_host_bytes / GIB,
                "host_bytes_per_param": self.host_bytes_per_param, "fits": self.fits,
                "bottleneck": self.critical_path.bottleneck}

    def to_json(self, *, timeline: bool = False) -> dict[str, Any]:
        """Everything as plain JSON data; the timeline only when asked (it is large)."""
        out: dict[str, Any] = {
            "iteration_s": self.iteration_s, "tokens_per_s": self.tokens_per_s,
            "iteration_times_s": list(self.iteration_times_s), "makespan_s": self.makespan_s,
            "tokens_per_iteration": self.tokens_per_iteration, "params": self.params,
            "peak_bytes": self.peak_bytes, "capacity_bytes": self.capacity_bytes,
            "host_bytes_per_param": self.host_bytes_per_param, "busy_fraction": self.busy_fraction,
            "link_bytes": self.link_bytes, "fits": self.fits, "violation": self.violation,
            "critical_path": {"by_resource": self.critical_path.by_resource,
                              "by_kind": self.critical_path.by_kind,
                              "bottleneck": self.critical_path.bottleneck,
                              "actions": len(self.critical_path.actions)},
            "events": self.events, "wall_s": self.wall_s,
        }
        if timeline:
            out["timeline"] = self.timeline.to_json()
        return out


def lanes_per_resource(schedule: Schedule, lanes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """How many lanes ran each resource's actions: lanes holding one resource's actions only count (a lane
    that merges several, replay's CPU thread, counts for none of them)."""
    out: dict[str, int] = {}
    for ids in lanes.values():
        held = {schedule.actions[i].resource for i in ids}
        if len(held) == 1:
            r = held.pop()
            out[r] = out.get(r, 0) + 1
    return out


def build_result(schedule: Schedule, timeline: Timeline, *, partner: dict[int, int],
                 lanes: Mapping[str, Sequence[int]], params: int,
                 capacity_bytes: dict[str, int], peak_bytes: dict[str, int], link_bytes: dict[str, float],
                 violation: str | None, events: int, wall_s: float) -> SimResult:
    times = timeline.iteration_times_s()
    it = steady_state(times)
    span = timeline.makespan_s
    busy = timeline.busy_s()
    used = [r for r in schedule.resources if schedule.by_resource().get(r)]
    n_lanes = lanes_per_resource(schedule, lanes)
    return SimResult(
        iteration_s=it,
        tokens_per_s=schedule.tokens_per_iteration / it if it > 0 else 0.0,
        iteration_times_s=tuple(times),
        makespan_s=span,
        tokens_per_iteration=schedule.tokens_per_iteration,
        params=params,
        peak_bytes=dict(peak_bytes),
        capacity_bytes=dict(capacity_bytes),
        busy_fraction={r: (busy.get(r, 0.0) / span / max(1, n_lanes.get(r, 1)) if span > 0 else 0.0) for r in used},
        link_bytes={k: int(round(v)) for k, v in sorted(link_bytes.items())},
        critical_path=critical_path(schedule, timeline, partner, lanes),
        fits=violation is None,
        violation=violation,
        events=events,
        wall_s=wall_s,
        timeline=timeline,
    )
