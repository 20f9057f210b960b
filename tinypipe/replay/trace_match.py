"""Replay a real run's trace in the simulator: the same schedule, every action taking its measured time.

`tinypipe replay RUN_TRACE` reads the Chrome trace (or the Timeline JSON) of a `tinypipe run`,
recompiles the schedule that run executed (its settings come from the trace's `otherData.run`; the
command line may replace them), checks every record against the schedule's action of the
same id, then simulates the schedule with each action's duration taken from the trace. Where the
replay still differs from the measurement, the simulator's dependency or resource model lacks
something the executor does; where the prediction (the simulator with its own costs) differs from
the replay, the costs are off. `replay_report.py` puts the three side by side.

Decisions, each checked on real H200 runs' traces (docs/fidelity.md):
- The window. A run executes the compiled K iterations in windows (backends/rank/worker.py): a record's
  id is `action.id + shift * len(actions)`, `shift` the window's first step, and its iteration
  `action.iteration + shift`. Replay takes the first window that ran all K iterations (steps 0..K-1
  unless the run resumed): it is the compiled schedule from a cold start, as the simulator runs it,
  and it holds the K-1 iterations after the pipeline fill. A later window starts after a drain
  (streams synchronised, optimizer thread idle) and repeats only the first iterations. Every
  record of every window is still checked.
- Transfer halves. A RECV is posted before its data exists and its record runs from when its
  stream reached it to when the data arrived; a SEND's likewise waits for the receiver. The
  simulator's SEND / RECV rendezvous already adds that wait, so each half gets its *effective*
  duration: its end minus the later of the two halves' starts. With the recorded durations the
  wait counts twice: replayed steady iterations came out 35% (2 GPUs, sync) and 9% (async) long.
- The host optimizer. The schedule has one `host.optim` list; a run has one optimizer thread per
  rank (backends/rank/hostwork.py), and the ranks' steps overlap (147 of 204 consecutive OPT_STEPs in
  the 2-GPU async trace). Replay gives each rank's OPT_STEPs a lane of their own, in schedule
  order (`tinypipe.ir.order.run_lanes`, which the simulator now uses for every schedule); on one lane
  the 2-GPU replays came out 63% (sync) and 43% (async) long.
- The host's issue loop. A CUDA run's trace with the main thread's issue spans (`gN.issue`, cat ISSUE)
  replays its rank's loop too (`tinypipe.ir.issueloop`, sim/issuer.py): a device action starts no earlier
  than the host began to issue it, and the host issues one at a time, taking per action the loop's pass
  before it (the gap since the previous span, where the loop did not pause; else the device's mean
  pass) and its handler's time. In the eager sync Qwen3-1.7B run with 2 x 2048 per microbatch (H200,
  tests/data/h200-qwen3-1.7b-eager.trace.json.gz) issuing a block's FWD took longer than running it, so each
  layer's LOAD went only after the FWD before it and the next FWD waited ~1.9 ms for it: replayed
  without the loop the steady iteration came out 1.77% short, with it 0.02%. The loop's 0.5 ms pauses
  and the mean pass make the replay no longer a strict lower bound (+0.07% on that trace's first
  iteration). Traces without spans (before them) replay as before.
- The CPU stand-in. Under `--backend cpu` a rank's compute, h2d and d2h actions run one at a time on
  the rank's thread as they are issued (backends/rank/streams.py), so replay runs them as one lane per
  rank in their measured start order; transfers and optimizer steps keep their own lanes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinypipe.common.errors import InputError
from tinypipe.common.jsonio import load_json
from tinypipe.ir.issueloop import IDLE_SLEEP_S
from tinypipe.ir.kinds import recorded_as
from tinypipe.ir.order import run_lanes
from tinypipe.ir.schedule import Schedule, resource_gpu
from tinypipe.ir.timeline import FORMAT as TIMELINE_FORMAT
from tinypipe.ir.timeline import HOST_CAT, ISSUE_CAT, Record, Timeline

# How much earlier than a dependency's end a record may start and still count as after it: the host
# clock (OPT_STEP) and the CUDA events of a rank are aligned once per window; the committed H200
# traces show at most 43 us of skew, a trace of another schedule (sync read as async) seconds.
CLOCK_SLACK_S = 1e-3
RUN_KEY = "run"  # otherData[RUN_KEY]: what `tinypipe run --trace` records for replay
CPU_THREAD_STREAMS = ("compute", "h2d", "d2h")  # run on the rank's own thread under --backend cpu


class TraceMismatch(InputError):
    """The trace's records are not the recompiled schedule's actions."""


@dataclass(frozen=True)
class RunTrace:
    """The records of a real run (all windows) and its provenance (`otherData`, or a Timeline's meta)."""

    records: tuple[Record, ...]
    source: str  # cpu | cuda (| sim)
    meta: dict[str, Any] = field(default_factory=dict)
    where: str = "trace"
    # (device, record id, start s, end s) of each action's issue by its rank's main thread (ISSUE_CAT events)
    issue: tuple[tuple[str, int, float, float], ...] = ()

    def issue_by_device(self) -> dict[str, list[tuple[int, float, float]]]:
        """`issue` per device: (record id, start, end) of each span, in the trace's order."""
        out: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
        for device, rid, t0, t1 in self.issue:
            out[device].append((rid, t0, t1))
        return dict(out)

    @property
    def run(self) -> dict[str, Any]:
        """The run settings recorded for replay (`tinypipe run --trace`; empty for a simulated timeline)."""
        r = self.meta.get(RUN_KEY)
        return r if isinstance(r, dict) else {}

    @property
    def steps(self) -> int:
        return len({r.iteration for r in self.records})

    @property
    def gpus(self) -> int:
        return len({g for r in self.records if (g := resource_gpu(r.resource)) is not None})


def load_run_trace(path: str | Path) -> RunTrace:
    """A Chrome trace (`{"traceEvents": [...]}` or a bare event list) or a Timeline JSON of a run."""
    where = str(path)
    obj = load_json(path)
    if isinstance(obj, dict) and obj.get("format") == TIMELINE_FORMAT:
        tl = Timeline.from_json(obj, where)
        return RunTrace(tl.records, tl.source, dict(tl.meta), where)
    events = obj.get("traceEvents") if isinstance(obj, dict) else obj
    if not isinstance(events, list):
        raise InputError(f"{where}: neither a Chrome trace (traceEvents) nor a tinypipe timeline ({TIMELINE_FORMAT})")
    other = obj.get("otherData", {}) if isinstance(obj, dict) else {}
    other = other if isinstance(other, dict) else {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name"))
    records = []
    issue = []
    for n, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        fields = e.get("args") or {}  # the event's own `args`
        try:
            res = threads[(e.get("pid"), e.get("tid"))]
            t0, t1 = float(e["ts"]) / 1e6, (float(e["ts"]) + float(e["dur"])) / 1e6
            if e.get("cat") == ISSUE_CAT:  # not an action: the main thread's issue of one (`gN.issue`)
                issue.append((res.partition(".")[0], int(fields["id"]), t0, t1))
                continue
            if e.get("cat") == HOST_CAT:  # nor the rank's host between actions (`gN.host`)
                continue
            layer, mb = fields.get("layer"), fields.get("microbatch")
            records.append(Record(int(fields["id"]), res, str(e["cat"]), str(e.get("name", "")),
                                  None if layer is None else int(layer), None if mb is None else int(mb),
                                  int(fields["iteration"]), t0, t1))
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{where}: traceEvents[{n}] ({e.get('name')!r}): missing or bad {exc}; expected a "
                             "tinypipe run's event (a thread_name for its pid/tid, cat, ts, dur, args.id, "
                             "args.iteration)") from None
    if not records:
        raise InputError(f"{where}: no action events (ph 'X'): not the trace of a run")
    return RunTrace(tuple(records), str(other.get("source", "")), dict(other), where, tuple(issue))


def _describe(resource: str, kind: str, layer: int | None, mb: int | None, iteration: int) -> str:
    parts = [resource, kind] + ([f"L{layer}"] if layer is not None else []) + ([f"m{mb}"] if mb is not None else [])
    return " ".join(parts) + f" (iteration {iteration})"


def match_window(schedule: Schedule, trace: RunTrace, which: int = 0) -> tuple[int, tuple[Record, ...]]:
    """Check every record against the schedule; return the replayed window's first step and its records,
    renumbered to the schedule's ids and iterations (sorted by id). TraceMismatch names the first bad id.
    `which` picks among the windows the run executed whole: 0 the first, -1 the last."""
    acts = schedule.actions
    stride = len(acts)
    want = "--policy, --model, --hardware, --seq-len, --batch-tokens, --iterations"
    windows: dict[int, dict[int, Record]] = defaultdict(dict)
    for r in sorted(trace.records, key=lambda r: r.id):
        if r.id < 0:
            raise TraceMismatch(f"{trace.where}: record id {r.id} is negative")
        shift, aid = divmod(r.id, stride)
        a = acts[aid]
        kind = a.kind.value if recorded_as(r.kind, a.kind) else r.kind
        got = (r.resource, kind, r.layer, r.microbatch, r.iteration)
        exp = (a.resource, a.kind.value, a.layer, a.microbatch, a.iteration + shift)
        if got != exp:
            names = ("resource", "kind", "layer", "microbatch", "iteration")
            diff = ", ".join(f"{n} {g} (schedule: {x})" for n, g, x in zip(names, got, exp) if g != x)
            raise TraceMismatch(f"{trace.where}: record id {r.id} is `{_describe(*got)}` but the schedule's action "
                                f"{aid} is `{_describe(*exp)}`: {diff}; the trace is not of this schedule "
                                f"({stride} actions, {schedule.iterations} iterations; check {want})")
        if aid in windows[shift]:
            raise TraceMismatch(f"{trace.where}: record id {r.id} appears twice")
        windows[shift][aid] = r
    full = [s for s, w in sorted(windows.items()) if len(w) == stride]
    if not full:
        most = max(windows.values(), key=len)
        missing = min(set(range(stride)) - set(most))
        raise TraceMismatch(f"{trace.where}: no window of the run executed all {stride} actions of the "
                            f"{schedule.iterations}-iteration schedule (first missing: action {missing}, "
                            f"`{acts[missing]}`); give --iterations to match the run")
    if not -len(full) <= which < len(full):
        raise TraceMismatch(f"{trace.where}: the run executed {len(full)} whole window(s) of the "
                            f"{schedule.iterations}-iteration schedule; window {which} is not one of them")
    shift = full[which]
    recs = tuple(Record(aid, r.resource, acts[aid].kind.value, r.label, r.layer, r.microbatch, r.iteration - shift,
                        r.start_s, r.end_s) for aid, r in sorted(windows[shift].items()))
    run = windows[shift]
    for a in acts:  # same actions, but the same dependencies? A run never starts an action before them.
        for d in a.deps:
            early = run[d].end_s - run[a.id].start_s
            if early > CLOCK_SLACK_S:
                raise TraceMismatch(
                    f"{trace.where}: record id {run[a.id].id} (`{_describe(*_fields(run[a.id]))}`) started "
                    f"{early:.3f} s before its dependency, record id {run[d].id} (`{_describe(*_fields(run[d]))}`), "
                    "ended: the run "
                    f"did not have this schedule's dependencies (another optimizer mode or prefetch depth?); check "
                    f"--policy")
    return shift, recs


def _fields(r: Record) -> tuple[str, str, int | None, int | None, int]:
    return r.resource, r.kind, r.layer, r.microbatch, r.iteration


def effective_durations(window: Sequence[Record], partner: Mapping[int, int]) -> dict[int, float]:
    """Seconds per action id (window sorted by id, ids 0..n-1): a record's duration, except that a
    SEND / RECV half counts from the later of the two halves' starts (see the module docstring)."""
    out = {}
    for r in window:
        p = partner.get(r.id)
        begin = r.start_s if p is None else max(r.start_s, window[p].start_s)
        out[r.id] = max(0.0, r.end_s - begin)
    return out


def lanes(schedule: Schedule, window: Sequence[Record], source: str) -> dict[str, tuple[int, ...]]:
    """The per-lane action lists that the run really had (see the module docstring): one optimizer lane
    per rank (`tinypipe.ir.order.run_lanes`, as the simulator runs any schedule); under the CPU backend one
    lane per rank for its compute, h2d and d2h, in measured order."""
    out: dict[str, list[int]] = defaultdict(list)
    for name, ids in run_lanes(schedule).items():
        g = resource_gpu(name)
        for i in ids:
            if source == "cpu" and g is not None and name.split(".", 1)[1] in CPU_THREAD_STREAMS:
                out[f"g{g}.thread"].append(i)
            else:
                out[name].append(i)
    for name, lane in out.items():
        if name.endswith(".thread"):
            lane.sort(key=lambda i: (window[i].start_s, i))
    return {k: tuple(v) for k, v in out.items() if v}


def issue_durations(trace: RunTrace, first_id: int, n: int) -> dict[int, tuple[float, float]] | None:
    """Per action of the window (ids 0..n-1, the records' from `first_id`), the seconds its rank's main
    thread spent on it: the loop's pass before the handler and the handler (`RunTrace.issue`, see the
    module docstring); None for a trace without issue spans."""
    if not trace.issue or trace.source != "cuda":  # the CPU stand-in's thread lane has the host's order already
        return None
    out = {}
    for spans in trace.issue_by_device().values():
        got = sorted(spans, key=lambda x: (x[1], x[2], x[0]))  # by start on the host clock
        gaps = [(b[1] - a[2], b[0]) for a, b in zip(got, got[1:])]
        passes = [g for g, _ in gaps if 0 <= g < IDLE_SLEEP_S]  # the loop did not pause between the two
        usual = sum(passes) / len(passes) if passes else 0.0
        before = {rid: g if 0 <= g < IDLE_SLEEP_S else usual for g, rid in gaps}
        for rid, t0, t1 in got:
            if 0 <= rid - first_id < n:
                out[rid - first_id] = (before.get(rid, usual), t1 - t0)
    return out


def opt_threads(schedule: Schedule) -> int:
    """Optimizer threads in a run of this schedule: one per rank that owns a layer."""
    return max(1, len(set(schedule.pack_gpu)))
