"""When each action of a rank runs: per-resource list order plus dependencies, like CUDA streams + events.

`run_actions` takes a window of one rank's actions (those of the schedule's first n iterations)
and runs them through an `Interpreter`. Dependencies on actions outside the window are taken as met (an
earlier window finished them, or another rank's half of a SEND / RECV pair).

CPU: one loop repeatedly starts the lowest-id action that heads its resource's list and whose
dependencies have finished; SEND / RECV run asynchronously and finish when their transfer does.
CUDA: the same loop *issues* actions instead: each resource is a stream, each dependency an event
the stream waits for; OPT_STEP runs on the host once the events it depends on (and the uploads of
its layer still in flight) have completed.

Every action is timed into `tinypipe.timeline.Record`s (CPU: `time.perf_counter`, CUDA: events),
the schedule's memory effects are applied to a `Ledger`, and the executed per-resource order kept.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tinypipe.schedule import Action, Kind
from tinypipe.timeline import Record

from .comm import Handle
from .interpreter import ExecutionError, Interpreter, StepData

STUCK_S = 300.0  # no progress for this long: report what each resource waits for


@dataclass
class Ledger:
    """Bytes per device from the schedule's memory effects (allocs at start, frees at end)."""

    static: dict[str, int] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    live: dict[tuple[str, str], int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def start(self, a: Action) -> None:
        for m in a.allocs:
            if (m.device, m.buffer) in self.live:
                self.problems.append(f"action {a.id} allocates {m.device}:{m.buffer}, which is already live")
            self.live[(m.device, m.buffer)] = m.nbytes
            self.current[m.device] += m.nbytes
            total = self.current[m.device] + self.static.get(m.device, 0)
            self.peak[m.device] = max(self.peak[m.device], total)

    def end(self, a: Action) -> None:
        for m in a.frees:
            if self.live.pop((m.device, m.buffer), None) is None:
                self.problems.append(f"action {a.id} frees {m.device}:{m.buffer}, which is not live")
            self.current[m.device] -= m.nbytes


@dataclass
class RunLog:
    """What one window of actions did on one rank."""

    records: list[Record] = field(default_factory=list)
    order: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # resource -> ids started
    memory: list[tuple[float, int]] = field(default_factory=list)  # (t_s, device bytes) after each action
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (the head's owner only)

    def extend(self, other: RunLog) -> None:
        self.records += other.records
        for r, ids in other.order.items():
            self.order[r] += ids
        self.memory += other.memory
        self.losses.update(other.losses)


def run_actions(interp: Interpreter, actions: Sequence[Action], data: dict[int, StepData], *, shift: int = 0,
                ledger: Ledger | None = None, id_stride: int = 0) -> RunLog:
    """Run `actions` (one rank's, in schedule order) for steps `a.iteration + shift`.

    `data` holds the input of each step. Timeline record ids are `a.id + shift * id_stride`, so
    that windows repeating the schedule stay distinct (`id_stride`: the schedule's length).
    """
    interp.data = data
    ledger = ledger if ledger is not None else Ledger()
    by_id = {a.id: a for a in actions}
    queues: dict[str, deque[Action]] = defaultdict(deque)
    for a in actions:
        queues[a.resource].append(a)
    loads_left: dict[tuple[int, int], int] = defaultdict(int)
    for a in actions:
        if a.kind == Kind.LOAD:
            for layer in interp.reads(a.layer):  # type: ignore[arg-type]
                loads_left[(layer, a.iteration + shift)] += 1
    interp.pending_loads = dict(loads_left)
    cuda = interp.device.type == "cuda"
    log = RunLog()
    timer = _CudaTimer(interp) if cuda else None
    done: set[int] = set()
    running: dict[str, tuple[Action, tuple[Handle, Callable[[], None]], float]] = {}
    idle_since = time.perf_counter()
    action_ids: list[int] = []  # parallel to log.records

    def ready(a: Action) -> bool:
        return all(d in done or d not in by_id for d in a.deps)

    def finish(a: Action, t0: float) -> None:
        t1 = time.perf_counter()
        ledger.end(a)
        done.add(a.id)
        action_ids.append(a.id)
        step = a.iteration + shift
        log.records.append(Record(a.id + shift * id_stride, a.resource, a.kind.value, a.label, a.layer,
                                  a.microbatch, step, t0, t1))
        log.memory.append((t1, torch.cuda.memory_allocated(interp.device) if cuda else interp.device_bytes()))

    while queues or running:
        for res, (a, (handle, on_done), t0) in list(running.items()):
            if handle.is_completed():
                handle.wait()  # surfaces a failed transfer
                on_done()
                del running[res]
                finish(a, t0)
                idle_since = time.perf_counter()
        heads = [q[0] for r, q in queues.items() if r not in running and ready(q[0])]
        if not heads:
            if not running:
                if not queues:
                    break
                raise ExecutionError(_stuck(interp.rank, queues, done, by_id))
            if time.perf_counter() - idle_since > STUCK_S:
                raise ExecutionError(_stuck(interp.rank, queues, done, by_id) + "; a transfer never completed: "
                                     + ", ".join(f"{a.id} ({a})" for a, _, _ in running.values()))
            time.sleep(5e-5)
            continue
        a = min(heads, key=lambda x: x.id)
        q = queues[a.resource]
        q.popleft()
        if not q:
            del queues[a.resource]
        log.order[a.resource].append(a.id)
        ledger.start(a)
        if timer is not None:
            timer.before(a, by_id, done)  # OPT_STEP: waits here for its gradients to land
        t0 = time.perf_counter()
        started = interp.dispatch(a, a.iteration + shift)
        if timer is not None:
            if started is not None:
                started[0].wait()  # NCCL: the stream (not the CPU) waits for the transfer
                started[1]()
            timer.after(a)
            started = None
        if started is None:
            finish(a, t0)
        else:
            running[a.resource] = (a, started, t0)
        idle_since = time.perf_counter()
    if timer is not None:
        log.records = timer.records(log.records, action_ids)
    for (step, _m), loss in sorted(interp.losses.items()):
        log.losses[step] = log.losses.get(step, 0.0) + float(loss.item())
    interp.losses.clear()
    return log


def _stuck(rank: int, queues: dict[str, deque[Action]], done: set[int], by_id: dict[int, Action]) -> str:
    waits = []
    for res, q in sorted(queues.items()):
        a = q[0]
        missing = [d for d in a.deps if d in by_id and d not in done]
        waits.append(f"{res} at {a.id} ({a}) waits for {missing or 'its stream'}")
    return f"rank {rank}: the schedule cannot progress: " + "; ".join(waits)


class _CudaTimer:
    """Streams, dependency events and timing events for the CUDA path."""

    def __init__(self, interp: Interpreter) -> None:
        self.interp = interp
        self.start: dict[int, torch.cuda.Event] = {}
        self.end: dict[int, torch.cuda.Event] = {}
        self.loads: dict[int, list[torch.cuda.Event]] = defaultdict(list)  # layer -> uploads in flight
        torch.cuda.synchronize(interp.device)
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record()
        torch.cuda.synchronize(interp.device)
        self.base_s = time.perf_counter()
        self._ctx: torch.cuda.StreamContext | None = None
        interp.use = lambda t: t.record_stream(torch.cuda.current_stream(interp.device))

    def stream(self, resource: str) -> torch.cuda.Stream:
        """The resource's stream, made once per rank: a stream is where cuBLAS caches its workspace,
        so fresh streams for every window would each cost a new one."""
        streams = self.interp.streams
        if resource not in streams:
            streams[resource] = torch.cuda.Stream(self.interp.device)
        return streams[resource]  # type: ignore[no-any-return]

    def before(self, a: Action, by_id: dict[int, Action], done: set[int]) -> None:
        deps = [d for d in a.deps if d in self.end]
        if a.kind == Kind.OPT_STEP:  # host work: the gradients must have landed, the uploads finished
            for d in deps:
                self.end[d].synchronize()
            for ev in self.loads.pop(a.layer, []):  # type: ignore[arg-type]
                ev.synchronize()
            return
        s = self.stream(a.resource)
        for d in deps:
            s.wait_event(self.end[d])
        self._ctx = torch.cuda.stream(s)
        self._ctx.__enter__()
        self.start[a.id] = torch.cuda.Event(enable_timing=True)
        self.start[a.id].record(s)

    def after(self, a: Action) -> None:
        if a.kind == Kind.OPT_STEP:
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.end[a.id] = ev
        if a.kind == Kind.LOAD:
            self.loads[a.layer].append(ev)  # type: ignore[index]
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def records(self, recs: list[Record], action_ids: list[int]) -> list[Record]:
        """Device times for the actions issued to streams (host work keeps its host times)."""
        torch.cuda.synchronize(self.interp.device)
        out = []
        for r, aid in zip(recs, action_ids):
            if r.kind != Kind.OPT_STEP.value and aid in self.start:
                t0 = self.base_s + self.base.elapsed_time(self.start[aid]) / 1e3
                t1 = self.base_s + self.base.elapsed_time(self.end[aid]) / 1e3
                r = Record(r.id, r.resource, r.kind, r.label, r.layer, r.microbatch, r.iteration, t0, t1)
            out.append(r)
        return out
