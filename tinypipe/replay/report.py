"""The replay report: measured, replayed and predicted iteration times side by side; per resource busy and
idle time; per action kind the measured duration against the simulator's; and the waits the replay
cannot explain.

Definitions. Iteration times are `Timeline.iteration_times_s` of each timeline (the measured one is
the replayed window, renumbered to the schedule's ids and iterations); "steady" is their mean from
iteration `warmup` on. Per-kind and per-resource figures cover the steady iterations (by the records'
iteration field) and are given per iteration. A SEND / RECV half's duration counts from the later of
the two halves' starts, in the measurement and in the prediction alike (replay.effective_durations).
Kinds are split by layer kind (`BWD block`, `BWD head`), the granularity of the profile's costs.

Unexplained waits. The replay starts every action as soon as its lane predecessor and dependencies
have ended. Walking the measured timeline's critical path back from the window's last FWD / BWD,
each action that started later than everything it waits for had ended shows a gap the replay does
not have: host dispatch, one rank starting after another, work outside the schedule. The gaps are
summed per resource and kind, and per iteration beside measured minus replayed. (Where the trace has
the main thread's issue spans the replay runs the host's issue loop, so part of such a gap is then
replayed: the report still lists it.)
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tinypipe.common import table
from tinypipe.describe.model import ModelSpec
from tinypipe.ir.kinds import COMPUTE_KINDS
from tinypipe.ir.order import predecessors
from tinypipe.ir.schedule import HOST_OPTIM, Schedule
from tinypipe.ir.timeline import Record, Timeline, resource_sort_key
from tinypipe.replay.trace_match import effective_durations


@dataclass(frozen=True)
class KindRow:
    """One action kind (and layer kind) over the steady iterations."""

    kind: str
    per_iteration: float  # actions per iteration
    measured_ms: float  # mean duration
    predicted_ms: float

    @property
    def ratio(self) -> float | None:
        return self.measured_ms / self.predicted_ms if self.predicted_ms > 0 else None

    @property
    def delta_s(self) -> float:
        """Seconds per iteration the measurement spends in this kind beyond the prediction."""
        return self.per_iteration * (self.measured_ms - self.predicted_ms) / 1e3


@dataclass(frozen=True)
class ResourceRow:
    """One resource, seconds per steady iteration; idle = threads x iteration - busy."""

    resource: str
    threads: int  # lanes the run and the simulator had for it (host.optim: one per rank)
    busy_measured_s: float
    busy_predicted_s: float
    idle_measured_s: float
    idle_predicted_s: float


@dataclass(frozen=True)
class GapRow:
    """Waits on the measured critical path, charged to the resource and kind of the action that waited."""

    resource: str
    kind: str
    total_s: float
    count: int
    largest_s: float
    largest: str  # the action that waited longest: `LD0 i0`


@dataclass(frozen=True)
class ReplayReport:
    header: dict[str, Any]
    measured_s: tuple[float, ...]  # per iteration
    replayed_s: tuple[float, ...]
    predicted_s: tuple[float, ...]
    gap_s: tuple[float, ...]  # critical-path gaps per iteration
    warmup: int
    resources: tuple[ResourceRow, ...]
    kinds: tuple[KindRow, ...]
    gaps: tuple[GapRow, ...]
    issue_busy_s: Mapping[str, float] = field(default_factory=dict)  # device -> main thread issuing, s / iteration

    def steady(self, times: Sequence[float]) -> float:
        return steady(times, self.warmup)

    @property
    def replay_error(self) -> float:
        """(replayed - measured) / measured, steady iterations."""
        m = self.steady(self.measured_s)
        return (self.steady(self.replayed_s) - m) / m if m > 0 else 0.0

    @property
    def prediction_error(self) -> float:
        m = self.steady(self.measured_s)
        return (self.steady(self.predicted_s) - m) / m if m > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **self.header, "warmup": self.warmup,
            "iteration_s": {"measured": list(self.measured_s), "replayed": list(self.replayed_s),
                            "predicted": list(self.predicted_s), "critical_path_gaps": list(self.gap_s)},
            "steady_s": {"measured": self.steady(self.measured_s), "replayed": self.steady(self.replayed_s),
                         "predicted": self.steady(self.predicted_s)},
            "replay_error": self.replay_error, "prediction_error": self.prediction_error,
            "resources": [asdict(r) for r in self.resources],
            "kinds": [{**asdict(k), "ratio": k.ratio, "delta_s": k.delta_s} for k in self.kinds],
            "gaps": [asdict(g) for g in self.gaps],
            "issue_busy_s": dict(self.issue_busy_s),
        }

    def table(self, top: int = 8) -> str:
        h = self.header
        u, k = ("s", 1.0) if self.steady(self.measured_s) >= 1 else ("ms", 1e3)  # the unit of the times shown
        out = [f"replay of {h['trace']}: {h['model']} on {h['hardware']}, policy {h['policy']}, {h['gpus']} GPU(s), "
               f"{h['source']} run",
               f"window: steps {h['first_step']}..{h['first_step'] + h['iterations'] - 1} = the schedule's "
               f"{h['iterations']} iterations, {h['actions']:,} actions, every record of the trace's "
               f"{h['records']:,} matched; steady = " + (f"iterations {self.warmup}..{h['iterations'] - 1}"
                                                        if h["iterations"] > self.warmup
                                                        else f"iteration {h['iterations'] - 1}, the last"), ""]
        m, r, p = self.measured_s, self.replayed_s, self.predicted_s
        rows: list[list[Any]] = [[str(i), k * m[i], k * r[i], k * p[i], _pct(r[i], m[i]), _pct(p[i], m[i]),
                                  k * self.gap_s[i]] for i in range(len(m))]
        sm, sr, sp = self.steady(m), self.steady(r), self.steady(p)
        rows.append(["steady", k * sm, k * sr, k * sp, _pct(sr, sm), _pct(sp, sm), k * self.steady(self.gap_s)])
        out.append(table.render(["iteration", f"measured {u}", f"replayed {u}", f"predicted {u}", "replay err",
                                 "predict err", f"waits on path {u}"], rows, align="lrrrrrr"))
        starts = h.get("first_start_s", {})
        if len(starts) > 1:
            out.append("first action on each device, after the window's first: " + ", ".join(
                f"{d} {k * t:+.3f} {u}" for d, t in starts.items()) + " (the replay starts every device at once)")
        out += ["", f"per resource, {u} per steady iteration (idle = threads x iteration - busy):"]
        out.append(table.render(
            ["resource", "threads", "busy measured", "busy predicted", "idle measured", "idle predicted"],
            [[x.resource, x.threads, k * x.busy_measured_s, k * x.busy_predicted_s, k * x.idle_measured_s,
              k * x.idle_predicted_s] for x in self.resources], align="lrrrrr"))
        if self.issue_busy_s:
            busy = ", ".join(f"{d} {k * b:.3f} {u} ({b / sm:.0%})" for d, b in self.issue_busy_s.items())
            out.append(f"main thread issuing the device's work (the trace's gN.issue), per steady iteration: {busy} "
                       "(near 100%: the run waits for its host to issue; the replay runs the host's issue loop with "
                       "these spans, the prediction charges the profile's issue times)")
        out += ["", f"per action kind, steady iterations, largest |delta| first (delta = count x (measured - "
                f"predicted), {u} per iteration):"]
        out.append(table.render(
            ["kind", "per iteration", "measured ms", "predicted ms", "measured/predicted", f"delta {u}"],
            [[x.kind, int(x.per_iteration) if x.per_iteration == int(x.per_iteration) else round(x.per_iteration, 2),
              x.measured_ms, x.predicted_ms,
              "-" if x.ratio is None else f"{x.ratio:.3f}", k * x.delta_s] for x in self.kinds[:top]],
            align="lrrrrr"))
        if len(self.kinds) > top:
            out.append(f"... {len(self.kinds) - top} more kinds in --json")
        if h.get("optimizer_threads", 1) > 1:
            out.append(f"OPT_STEP: the run steps on {h['optimizer_threads']} host threads at once (one per rank), the "
                       "simulator on one lane with the whole host's rate")
        out += ["", f"what the replay cannot explain: measured - replayed = {k * (sum(m) - sum(r)):+.3f} {u} over the "
                f"window, at most the {k * sum(self.gap_s):.3f} {u} of waits on the measured critical path (an action "
                "starting after all it waits for had ended), largest first:"]
        out.append(table.render(["resource", "kind", f"total {u}", "waits", f"largest {u}", "largest at"],
                                [[g.resource, g.kind, k * g.total_s, g.count, k * g.largest_s, g.largest]
                                 for g in self.gaps[:top]], align="llrrrl"))
        return "\n".join(out)


def steady(times: Sequence[float], warmup: int) -> float:
    """Mean of the iteration times from `warmup` on (the last one when there are no more)."""
    t = list(times)
    return statistics.fmean(t[warmup:]) if len(t) > warmup else (t[-1] if t else 0.0)


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x - ref) / ref:+.2f}%" if ref > 0 else "-"


def _kind_key(model: ModelSpec, r: Record) -> str:
    return r.kind if r.layer is None else f"{r.kind} {model.layers[r.layer].kind.value}"


def kind_rows(model: ModelSpec, measured: Sequence[Record], predicted: Sequence[Record],
              partner: Mapping[int, int], warmup: int) -> tuple[KindRow, ...]:
    """Mean effective duration per kind over the steady iterations, measured against predicted."""
    dm, dp = effective_durations(measured, partner), effective_durations(predicted, partner)
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    iterations = {r.iteration for r in measured if r.iteration >= warmup} or {r.iteration for r in measured}
    for r in measured:
        if r.iteration in iterations:
            e = acc[_kind_key(model, r)]
            e[0] += 1
            e[1] += dm[r.id]
            e[2] += dp[r.id]
    n = len(iterations)
    rows = [KindRow(k, c / n, 1e3 * sm / c, 1e3 * sp / c) for k, (c, sm, sp) in acc.items()]
    return tuple(sorted(rows, key=lambda k: (-abs(k.delta_s), k.kind)))


def resource_rows(schedule: Schedule, measured: Timeline, predicted: Timeline, warmup: int,
                  optim_threads: int) -> tuple[ResourceRow, ...]:
    def busy(tl: Timeline) -> tuple[dict[str, float], float]:
        its = {r.iteration for r in tl.records if r.iteration >= warmup} or {r.iteration for r in tl.records}
        out: dict[str, float] = defaultdict(float)
        for r in tl.records:
            if r.iteration in its:
                out[r.resource] += r.duration_s / len(its)
        return out, steady(tl.iteration_times_s(), warmup)

    bm, im = busy(measured)
    bp, ip = busy(predicted)
    rows = []
    for res in sorted(bm.keys() | bp.keys(), key=resource_sort_key):
        threads = optim_threads if res == HOST_OPTIM else 1
        rows.append(ResourceRow(res, threads, bm.get(res, 0.0), bp.get(res, 0.0), threads * im - bm.get(res, 0.0),
                                threads * ip - bp.get(res, 0.0)))
    return tuple(rows)


def critical_gaps(schedule: Schedule, window: Sequence[Record], lane_lists: Mapping[str, Sequence[int]],
                  partner: Mapping[int, int]) -> tuple[tuple[float, ...], tuple[GapRow, ...]]:
    """Gaps on the measured critical path (see the module docstring): per iteration, and per resource and kind."""
    before = predecessors(schedule.actions, partner=partner, lanes=lane_lists)  # in the run's own lanes
    start = [r.start_s for r in window]
    end = [r.end_s for r in window]
    t0 = min(start, default=0.0)
    ends = Timeline(tuple(window)).iteration_ends_s()
    compute = [r for r in window if r.kind in COMPUTE_KINDS] or list(window)
    cur = max(compute, key=lambda r: (r.end_s, r.id)).id
    per_iteration = [0.0] * len(ends)
    acc: dict[tuple[str, str], list[Any]] = {}
    seen: set[int] = set()
    while cur not in seen:
        halves = [cur] + ([partner[cur]] if cur in partner else [])
        seen.update(halves)
        late = max(halves, key=lambda h: (start[h], h))  # a copy starts when its later half does
        cands = [x for x in before[cur] if x not in halves]
        best = max(cands, key=lambda i: (end[i], i)) if cands else None
        gap = start[late] - (t0 if best is None else end[best])
        if gap > 0:
            r = window[late]
            per_iteration[min(bisect.bisect_left(ends, start[late]), len(ends) - 1)] += gap
            e = acc.setdefault((r.resource, r.kind), [0.0, 0, 0.0, ""])
            e[0] += gap
            e[1] += 1
            if gap > e[2]:
                e[2], e[3] = gap, f"{r.label} i{r.iteration}"
        if best is None:
            break
        cur = best
    rows = [GapRow(res, kind, t, c, big, at) for (res, kind), (t, c, big, at) in acc.items()]
    return tuple(per_iteration), tuple(sorted(rows, key=lambda g: (-g.total_s, g.resource, g.kind)))
