"""Timeline: what ran where and when, plus memory over time — one type for simulated and real runs.

A Timeline holds one record per action (resource, kind, start and end in seconds) and memory
samples per device. It exports Chrome trace JSON (opens in Perfetto: one process per device, one
thread per stream, memory as counters), saves and loads itself as JSON, and `diff` compares two
timelines of the same schedule (per-kind duration error, iteration time error, per-resource order).

Iteration times come from the records' `iteration` fields: iteration i is complete when its last
action and those of all earlier iterations have ended, and lasts from the completion of iteration
i-1 (for i = 0: from the first start). The steady-state
iteration time is the mean of the iterations after the first (the first includes pipeline fill
and cold loads), or the only iteration when there is one.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import Fields, load_json
from tinypipe.common.units import MIB
from tinypipe.ir.kinds import COMPUTE_KINDS, GPU_STREAMS

FORMAT = "tinypipe.ir.timeline/1"
STREAM_ORDER = (*GPU_STREAMS, "optim")
ISSUE_CAT = "ISSUE"  # a Chrome trace's events of the main thread's issue spans (`Timeline.to_chrome_trace`)
ISSUE_TID = 90  # their thread ids: ISSUE_TID + n, below the extra streams' 100+
# the rank's host between its device actions: its work between windows and Python's garbage collections
# (`RankResult.host`), on thread `<device>.host`; not actions either
HOST_CAT = "HOST"
HOST_TID = 80


def steady_state(iteration_times_s: list[float]) -> float:
    """Mean of the iteration times after the first (which fills the pipeline), or the only one.

    The mean, not the median: iterations after the first can alternate long and short when work
    of one overlaps the next, and the mean is then the long-run rate.
    """
    t = iteration_times_s
    return statistics.fmean(t[1:]) if len(t) > 1 else (t[0] if t else 0.0)


def issue_s_per_iteration(spans: Iterable[tuple[int, float, float]], iteration_of: Mapping[int, int],
                          iterations: Iterable[int]) -> float:
    """Seconds per iteration of `iterations` that a main thread spent issuing their actions: `spans` are
    (record id, start, end) of each issue (`RunLog.issue`), `iteration_of` maps a record id to its iteration."""
    keep = set(iterations)
    return sum(b - a for rid, a, b in spans if iteration_of.get(rid) in keep) / max(1, len(keep))


class Record(NamedTuple):
    """One action as it ran: times in seconds (a tuple: cheap to make by the ten thousand)."""

    id: int
    resource: str  # `g0.compute`, `host.optim`
    kind: str  # Kind value: `FWD`, `LOAD`, ...
    label: str  # compact cell label: `F3.2`, `LD12`
    layer: int | None
    microbatch: int | None
    iteration: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def device(self) -> str:
        return self.resource.split(".", 1)[0]


def resource_sort_key(resource: str) -> tuple[int, int, int, str]:
    """GPUs in index order, streams in STREAM_ORDER, host last."""
    dev, _, stream = resource.partition(".")
    s = STREAM_ORDER.index(stream) if stream in STREAM_ORDER else len(STREAM_ORDER)
    if dev.startswith("g") and dev[1:].isdigit():
        return (0, int(dev[1:]), s, resource)
    return (1, 0, s, resource)


@dataclass(frozen=True)
class Timeline:
    """Records (any order; kept sorted by start) and memory samples `device -> ((t_s, bytes), ...)`."""

    records: tuple[Record, ...]
    memory: dict[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    source: str = "sim"  # sim | cpu | cuda
    meta: dict[str, str] = field(default_factory=dict)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def start_s(self) -> float:
        return min((r.start_s for r in self.records), default=0.0)

    @property
    def end_s(self) -> float:
        return max((r.end_s for r in self.records), default=0.0)

    @property
    def makespan_s(self) -> float:
        return self.end_s - self.start_s

    def resources(self) -> list[str]:
        return sorted({r.resource for r in self.records}, key=resource_sort_key)

    def by_resource(self) -> dict[str, list[Record]]:
        """Records per resource in the order they started (ties by id)."""
        out: dict[str, list[Record]] = defaultdict(list)
        for r in sorted(self.records, key=lambda r: (r.start_s, r.id)):
            out[r.resource].append(r)
        return {k: out[k] for k in sorted(out, key=resource_sort_key)}

    def iteration_ends_s(self) -> list[float]:
        """When each iteration 0..K-1 is complete: its last FWD/BWD and every earlier iteration's have ended.

        GPU work marks the boundary, not the last action of any kind: under the async optimizer an
        iteration's optimizer steps run during the next one, so "all actions done" would make
        consecutive iterations end almost together. Optimizer waits still count, because the next
        iteration's uploads wait on them. Without compute records, all records mark it.
        """
        compute = [r for r in self.records if r.kind in COMPUTE_KINDS] or self.records
        ends: dict[int, float] = {}
        for r in compute:
            ends[r.iteration] = max(ends.get(r.iteration, r.end_s), r.end_s)
        out: list[float] = []
        for i in sorted(ends):
            out.append(max(ends[i], out[-1]) if out else ends[i])
        return out

    def iteration_times_s(self) -> list[float]:
        """Duration of each iteration: its end minus the previous one's end (the run's start for the first)."""
        ends = self.iteration_ends_s()
        prev = self.start_s
        out = []
        for e in ends:
            out.append(e - prev)
            prev = e
        return out

    def steady_iteration_s(self) -> float:
        """Median of the iteration times after the first, or the only one."""
        return steady_state(self.iteration_times_s())

    def busy_s(self) -> dict[str, float]:
        """Seconds each resource spent in actions."""
        out: dict[str, float] = defaultdict(float)
        for r in self.records:
            out[r.resource] += r.end_s - r.start_s
        return dict(out)

    def peak_bytes(self) -> dict[str, int]:
        return {d: max((b for _, b in s), default=0) for d, s in self.memory.items()}

    # ---- Chrome trace ----------------------------------------------------------------------------
    def to_chrome_trace(self, other_data: Mapping[str, Any] | None = None,
                        issue: Mapping[str, Sequence[tuple[int, float, float]]] | None = None,
                        host: Mapping[str, Sequence[tuple[str, float, float]]] | None = None) -> dict[str, Any]:
        """Chrome trace JSON (Perfetto, chrome://tracing): pid per device, tid per stream, times in µs.

        `otherData` holds the source and `meta`, then `other_data` (a real run adds what `tinypipe
        replay` needs to recompile its schedule, under "run"). `issue`: per device, (record id, start,
        end) of each action's issue by the rank's main thread (a real run's `RunLog.issue`), drawn on
        the device's thread `<device>.issue` as events of cat ISSUE_CAT named as the action (readers of
        the actions skip them: `tinypipe.replay.trace_match`). `host`: per device, (name, start, end) of the rank's
        other         host spans (`RankResult.host`), on `<device>.host` as events of cat HOST_CAT."""
        devices = sorted({r.device for r in self.records} | set(self.memory),
                         key=lambda d: resource_sort_key(d + "."))
        pid = {d: i for i, d in enumerate(devices)}
        events: list[dict[str, Any]] = []
        for d in devices:
            events.append({"ph": "M", "name": "process_name", "pid": pid[d], "tid": 0, "args": {"name": d}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid[d], "tid": 0,
                           "args": {"sort_index": pid[d]}})
        tids: dict[str, int] = {}
        for res in self.resources():
            dev, _, stream = res.partition(".")
            tid = STREAM_ORDER.index(stream) + 1 if stream in STREAM_ORDER else 100 + len(tids)
            tids[res] = tid
            events.append({"ph": "M", "name": "thread_name", "pid": pid[dev], "tid": tid, "args": {"name": res}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid[dev], "tid": tid,
                           "args": {"sort_index": tid}})
        t0 = self.start_s
        for r in sorted(self.records, key=lambda r: (r.start_s, r.id)):
            args: dict[str, Any] = {"id": r.id, "iteration": r.iteration}
            if r.layer is not None:
                args["layer"] = r.layer
            if r.microbatch is not None:
                args["microbatch"] = r.microbatch
            events.append({"ph": "X", "name": r.label, "cat": r.kind, "pid": pid[r.device], "tid": tids[r.resource],
                           "ts": (r.start_s - t0) * 1e6, "dur": (r.end_s - r.start_s) * 1e6, "args": args})
        labels = {r.id: r.label for r in self.records}

        def host_threads(spans: Mapping[str, Sequence[tuple[str, dict[str, Any], float, float]]], suffix: str,
                         first_tid: int, cat: str) -> None:
            """Per device, a thread `<device>.<suffix>` of (name, args, start, end) spans on the host clock."""
            for n, (d, named) in enumerate(sorted(spans.items())):
                if d not in pid or not named:
                    continue
                tid = first_tid + n
                events.extend([{"ph": "M", "name": "thread_name", "pid": pid[d], "tid": tid,
                                "args": {"name": f"{d}.{suffix}"}},
                               {"ph": "M", "name": "thread_sort_index", "pid": pid[d], "tid": tid,
                                "args": {"sort_index": 0}}])
                events.extend({"ph": "X", "name": name, "cat": cat, "pid": pid[d], "tid": tid, "ts": (a - t0) * 1e6,
                               "dur": (b - a) * 1e6, "args": args} for name, args, a, b in named)

        host_threads({d: [(labels.get(rid, str(rid)), {"id": rid}, a, b) for rid, a, b in spans]
                      for d, spans in (issue or {}).items()}, "issue", ISSUE_TID, ISSUE_CAT)
        host_threads({d: [(name, {}, a, b) for name, a, b in named] for d, named in (host or {}).items()},
                     "host", HOST_TID, HOST_CAT)
        for d, samples in self.memory.items():
            for t, b in samples:
                events.append({"ph": "C", "name": "memory", "pid": pid[d], "tid": 0,
                               "ts": (t - t0) * 1e6, "args": {"MiB": b / MIB}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, **self.meta, **(other_data or {})}}

    def save_chrome_trace(self, path: str | Path, other_data: Mapping[str, Any] | None = None,
                          issue: Mapping[str, Sequence[tuple[int, float, float]]] | None = None,
                          host: Mapping[str, Sequence[tuple[str, float, float]]] | None = None) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace(other_data, issue, host)), encoding="utf-8")

    # ---- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "meta": dict(self.meta),
            "columns": ["id", "resource", "kind", "label", "layer", "microbatch", "iteration", "start_s", "end_s"],
            "records": [[r.id, r.resource, r.kind, r.label, r.layer, r.microbatch, r.iteration, r.start_s, r.end_s]
                        for r in self.records],
            "memory": {d: [[t, b] for t, b in s] for d, s in self.memory.items()},
        }

    @classmethod
    def from_json(cls, obj: Any, where: str = "timeline") -> Timeline:
        f = Fields(obj, where)
        fmt = f.str("format")
        if fmt != FORMAT:
            raise InputError(f"{where}: format: expected {FORMAT!r}, got {fmt!r}")
        records = []
        for i, row in enumerate(f.list("records")):
            try:
                rid, res, kind, label, layer, mb, it, s, e = row
                records.append(Record(int(rid), str(res), str(kind), str(label),
                                      None if layer is None else int(layer), None if mb is None else int(mb),
                                      int(it), float(s), float(e)))
            except (TypeError, ValueError):
                raise InputError(f"{where}: records[{i}]: expected [id, resource, kind, label, layer, "
                                 f"microbatch, iteration, start_s, end_s], got {row!r}") from None
        memory: dict[str, tuple[tuple[float, int], ...]] = {}
        mem = f.raw("memory", {})
        if not isinstance(mem, dict):
            raise InputError(f"{where}: memory: expected an object of device -> [[t_s, bytes], ...]")
        for d, samples in mem.items():
            try:
                memory[str(d)] = tuple((float(t), int(b)) for t, b in samples)
            except (TypeError, ValueError):
                raise InputError(f"{where}: memory.{d}: expected a list of [t_s, bytes] pairs") from None
        meta = f.raw("meta", {})
        return cls(tuple(records), memory, f.str("source", "sim"),
                   {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Timeline:
        return cls.from_json(load_json(path), str(path))


# ---- diff ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KindError:
    """Duration error of one action kind: mean |a - b| in seconds and mean |a - b| / b."""

    count: int
    mean_abs_s: float
    mean_rel: float


@dataclass(frozen=True)
class TimelineDiff:
    """How timeline `a` differs from the reference `b` (matched by action id)."""

    per_kind: dict[str, KindError]
    iteration_s_a: float
    iteration_s_b: float
    orders_equal: bool
    order_mismatches: tuple[str, ...]  # resources whose action order differs
    only_in_a: tuple[int, ...]
    only_in_b: tuple[int, ...]

    @property
    def iteration_abs_error_s(self) -> float:
        return abs(self.iteration_s_a - self.iteration_s_b)

    @property
    def iteration_rel_error(self) -> float:
        return self.iteration_abs_error_s / self.iteration_s_b if self.iteration_s_b > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {
            "per_kind": {k: {"count": e.count, "mean_abs_s": e.mean_abs_s, "mean_rel": e.mean_rel}
                         for k, e in self.per_kind.items()},
            "iteration_s_a": self.iteration_s_a, "iteration_s_b": self.iteration_s_b,
            "iteration_rel_error": self.iteration_rel_error, "orders_equal": self.orders_equal,
            "order_mismatches": list(self.order_mismatches),
            "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b),
        }

    def table(self) -> str:
        """A small text table for people."""
        rows = [("kind", "count", "mean abs ms", "mean rel %")]
        rows += [(k, str(e.count), f"{e.mean_abs_s * 1e3:.3f}", f"{e.mean_rel * 100:.1f}")
                 for k, e in self.per_kind.items()]
        widths = [max(len(r[j]) for r in rows) for j in range(4)]
        lines = ["  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.append(f"iteration: {self.iteration_s_a:.4f} s vs {self.iteration_s_b:.4f} s "
                     f"({self.iteration_rel_error * 100:.1f}% error)")
        lines.append("per-resource order: " + ("equal" if self.orders_equal
                                                else "differs on " + ", ".join(self.order_mismatches)))
        return "\n".join(lines)


def _order(records: Iterable[Record]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.start_s, r.id)):
        out[r.resource].append(r.id)
    return out


def diff(a: Timeline, b: Timeline) -> TimelineDiff:
    """Compare `a` against the reference `b`: records are matched by action id.

    Per kind: mean absolute and mean relative (over records where b's duration is > 0) duration
    error; the steady-state iteration time of each; whether each resource ran its actions in the
    same order (by start time, ties by id).
    """
    ra = {r.id: r for r in a.records}
    rb = {r.id: r for r in b.records}
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])  # count, sum abs, sum rel, n rel
    for i in sorted(ra.keys() & rb.keys()):
        x, y = ra[i], rb[i]
        err = abs(x.duration_s - y.duration_s)
        e = acc[y.kind]
        e[0] += 1
        e[1] += err
        if y.duration_s > 0:
            e[2] += err / y.duration_s
            e[3] += 1
    per_kind = {k: KindError(int(v[0]), v[1] / v[0], v[2] / v[3] if v[3] else 0.0) for k, v in sorted(acc.items())}
    oa, ob = _order(a.records), _order(b.records)
    mismatches = tuple(sorted((res for res in oa.keys() | ob.keys() if oa.get(res) != ob.get(res)),
                              key=resource_sort_key))
    return TimelineDiff(per_kind, a.steady_iteration_s(), b.steady_iteration_s(), not mismatches, mismatches,
                        tuple(sorted(ra.keys() - rb.keys())), tuple(sorted(rb.keys() - ra.keys())))
