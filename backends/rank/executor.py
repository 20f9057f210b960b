"""When each action of a rank runs: per-resource list order plus dependencies, like CUDA streams + events.

`run_actions` takes a window of one rank's actions (those of the schedule's first n iterations)
and runs them through an `Interpreter` with an `IssueLoop`. Dependencies on actions outside the window
are taken as met (an earlier window finished them, or another rank's half of a SEND / RECV pair).

One loop *issues* actions: it repeatedly takes the lowest-id action that heads its resource's list
and whose dependencies are available, and hands it to the rank's `Streams` (`streams.py`): each
resource is a stream, each dependency an event the stream waits for. On the CPU stand-in the work
runs as it is issued; on CUDA it is enqueued and the loop goes on. The host blocks only where the
schedule needs it:
- OPT_STEP runs on the rank's host worker thread (`hostwork.py`), which first waits for the device
  work the step reads; actions that depend on a step wait until it has finished.
- Transfers whose handle the host must poll (gloo) hold their stream until they complete.
- The loop keeps at most RUNAHEAD_COMPUTE FWD / BWD in flight on the device: a freed block that
  another stream used is reusable only once the device has passed it, so a host running far ahead
  would make the caching allocator hold more than the schedule's ledger says.
- RECV gate: a RECV (which allocates its buffer when posted) is issued only once every FWD / BWD
  of this rank listed before it has been issued. A RECV has no dependencies of its own, so without
  this every receive of the window would be posted at its start (for an 8B model on 2 GPUs, hundreds
  of 64 MiB buffers at once). Issue order still follows a topological order
  (ids), so the gate cannot deadlock: the lowest unfinished action can always be issued.
- EVICT before LOAD: a LOAD is issued only once the device has run the EVICTs it depends on (their end
  markers). The caching allocator hands a freed block back only once every stream that used it has
  passed it, while a LOAD allocates when the host issues it: a host running ahead could hold the old
  and the new weights at once. A layer whose graph is kept from forward to backward (the head) holds
  its weights whatever the wait; tinypipe.compiler.passes.memory_pass counts that.

The readiness rules and the loop's constants are `tinypipe.ir.issueloop`'s; the simulator replays this loop
with a run's measured issue times (sim/issuer.py, `tinypipe replay`).

Every action is timed into `tinypipe.ir.timeline.Record`s (the streams' markers; the host clock for
OPT_STEP), the schedule's memory effects are applied to a `tinypipe.ir.ledger.Ledger` (allocs when an action is
issued, frees when it has finished), and the executed per-resource order kept.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from tinypipe.ir.issueloop import IDLE_SLEEP_S, RUNAHEAD_COMPUTE, issue_rules
from tinypipe.ir.kinds import Kind
from tinypipe.ir.ledger import Ledger
from tinypipe.ir.schedule import Action, gpu_resource
from tinypipe.ir.timeline import Record

from .comm import Handle
from .hostwork import HostWorker
from .interpreter import ExecutionError, Interpreter, StepData
from .streams import make_streams

STUCK_S = 300.0  # no progress for this long: report what each resource waits for


@dataclass
class Carried:
    """OPT_STEPs a window left running on the host worker, for the next window (`run_actions(carry=)`).

    Under the asynchronous optimizer the next step's forward does not wait for the last layers'
    updates, so a window that drained them before returning would leave the GPU idle for the tail of
    the optimizer (about a second per 4-step window for an 8B model). Instead the next window starts at
    once: each of its actions that touches a carried step's host state waits for that step alone --
    a LOAD for the steps whose version it wants (`Interpreter.want_version`), a GRAD_OUT for the
    earlier steps of the layers it hands gradients to. Device work was synchronised at the window's
    end, so a carried step's wait for its gradients' download has nothing left to wait for.
    """

    steps: dict[int, tuple[Action, Future[tuple[float, float]], int]] = field(default_factory=dict)
    # record id -> (the OPT_STEP, its future, the window's shift)

    def blocks(self, interp: Interpreter, a: Action, step: int) -> bool:
        """Whether `a` (of optimizer step `step`) must wait for an unfinished carried step."""
        if a.kind == Kind.LOAD:
            before = interp.want_version(step)  # steps below this must have run
        elif a.kind == Kind.GRAD_OUT:
            before = step
        else:
            return False
        layers = interp.reads(a.layer)
        return any(c.layer in layers and c.iteration + shift < before and not fut.done()
                   for c, fut, shift in self.steps.values())

    def collect(self, *, id_stride: int, ledger: Ledger, wait: bool = False) -> list[Record]:
        """Records of the carried steps that have finished (all of them with `wait`); re-raises a
        step's error."""
        out = []
        for rid, (a, fut, shift) in list(self.steps.items()):
            if not (wait or fut.done()):
                continue
            t0, t1 = fut.result()
            del self.steps[rid]
            ledger.end(a)
            out.append(_record(a, shift, id_stride, t0, t1))
        return out


@dataclass
class RunLog:
    """What one window of actions did on one rank."""

    records: list[Record] = field(default_factory=list)
    order: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # resource -> ids started
    memory: list[tuple[float, int]] = field(default_factory=list)  # (t_s, device bytes) after each action (`memory`)
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (the head's owner only)
    issued: list[int] = field(default_factory=list)  # action ids in the order the host issued them
    # with `run_actions(memory=True)` on CUDA: (t_s, record id, bytes) per issued device action, the
    # caching allocator's peak since the previous one was read, up to the end of this one's issue (its
    # allocations, made when it is issued, whatever the streams do later)
    peaks: list[tuple[float, int, int]] = field(default_factory=list)
    reserved_peak: int = 0  # the allocator's reserved bytes at most, over the same reads
    # (record id, start, end) on the host clock of each device action's issue by this thread: its handler
    # dispatching the work (an eager layer's kernels are launched here; the device may wait for them)
    issue: list[tuple[int, float, float]] = field(default_factory=list)

    def extend(self, other: RunLog) -> None:
        self.records += other.records
        for r, ids in other.order.items():
            self.order[r] += ids
        self.memory += other.memory
        self.losses.update(other.losses)
        self.issued += other.issued
        self.peaks += other.peaks
        self.issue += other.issue
        self.reserved_peak = max(self.reserved_peak, other.reserved_peak)


def run_actions(interp: Interpreter, actions: Sequence[Action], data: dict[int, StepData], *, shift: int = 0,
                ledger: Ledger | None = None, id_stride: int = 0, host_worker: HostWorker | None = None,
                carry: Carried | None = None, memory: bool = False) -> RunLog:
    """Run `actions` (one rank's, in schedule order) for steps `a.iteration + shift`: `IssueLoop(...).run()`.

    `data` holds the input of each step. Timeline record ids are `a.id + shift * id_stride`, so
    that windows repeating the schedule stay distinct (`id_stride`: the schedule's length).
    `host_worker` runs the OPT_STEPs (one is made for the window when None). With `carry` (and
    `host_worker`, which outlives the window) the window returns once its device work is done and
    leaves unfinished OPT_STEPs in `carry` (see `Carried`); the caller collects them with
    `carry.collect(wait=True)` before it reads the host state (a checkpoint, the end). `memory`, on
    CUDA: sample the device's memory after each action (`RunLog.memory`) and keep the allocator's peak
    per issued action (`RunLog.peaks`); a statistics read each (~0.2 ms of the issuing thread on an H200
    host), so off by default there. The CPU stand-in always samples (the interpreter's bytes).
    """
    if carry is not None and host_worker is None:
        raise ValueError("run_actions: carry needs the host worker that runs the carried steps")
    loop = IssueLoop(interp, actions, data, shift=shift, ledger=ledger, id_stride=id_stride,
                     host_worker=host_worker, carry=carry, memory=memory)
    return loop.run()


class IssueLoop:
    """One window of one rank's actions issued by the rank's main thread (module docstring): its state in fields,
    one method per step of the loop."""

    def __init__(self, interp: Interpreter, actions: Sequence[Action], data: dict[int, StepData], *, shift: int,
                 ledger: Ledger | None, id_stride: int, host_worker: HostWorker | None, carry: Carried | None,
                 memory: bool) -> None:
        self.interp, self.shift, self.id_stride, self.carry, self.memory = interp, shift, id_stride, carry, memory
        interp.data = data
        self.ledger = ledger if ledger is not None else Ledger(buffers=True)
        self.by_id = {a.id: a for a in actions}
        self.queues: dict[str, deque[Action]] = defaultdict(deque)
        for a in actions:
            self.queues[a.resource].append(a)
        # what each action waits for (tinypipe.ir.issueloop) on other resources; on its own resource the queue
        # issues it after the earlier ones, and the stream (or the host worker) runs them in order. A LOAD
        # allocates when the host issues it, but the weights an EVICT drops stay allocated until the device
        # has passed their last use (they were used on another stream): see "EVICT before LOAD"
        rules = issue_rules(actions)
        self.needs, self.evicts = rules.needs, rules.evicts
        loads_left: dict[tuple[int, int], int] = defaultdict(int)
        for a in actions:
            if a.kind == Kind.LOAD:
                for layer in interp.reads(a.layer):
                    loads_left[(layer, a.iteration + shift)] += 1
        interp.pending_loads = dict(loads_left)
        self.streams = make_streams(interp.device, kept=interp.streams, memory=interp.device_bytes)
        self.sample = memory or interp.device.type != "cuda"
        interp.use = self.streams.use
        self.own_worker = host_worker is None
        self.worker = host_worker if host_worker is not None else HostWorker()
        self.log = RunLog()
        self.available: set[int] = set()  # dependents may be issued after these
        self.running: dict[str, tuple[Action, tuple[Handle, Callable[[], None]]]] = {}  # transfers the host polls
        self.on_host: dict[int, tuple[Action, Future[tuple[float, float]]]] = {}  # OPT_STEPs submitted, not finished
        self.host_times: dict[int, tuple[float, float]] = {}
        self.in_flight: deque[int] = deque()  # FWD / BWD issued and maybe not finished on the device
        self.finished: list[int] = []  # ids in the order they finished (host view)
        self.compute = self.queues.get(gpu_resource(interp.rank, "compute"))
        self.freeing = False  # a LOAD was held back this pass until the device has run the EVICTs it follows
        self.idle_since = time.perf_counter()

    def run(self) -> RunLog:
        try:
            while self.queues or self.running or (self.on_host and self.carry is None):
                progressed = self._poll()
                self.freeing = False
                heads = [q[0] for r, q in self.queues.items() if r not in self.running and self._ready(q[0])]
                if heads:
                    self._issue(min(heads, key=lambda x: x.id))
                    self.idle_since = time.perf_counter()
                elif self._idle(progressed):
                    break
            self.streams.synchronize()
            if self.carry is not None:
                for aid, (a, fut) in self.on_host.items():
                    self.carry.steps[aid + self.shift * self.id_stride] = (a, fut, self.shift)
        finally:
            if self.own_worker:
                self.worker.close()
        return self._close()

    def _finish(self, a: Action) -> None:
        self.ledger.end(a)
        self.available.add(a.id)
        self.finished.append(a.id)
        if self.sample:
            self.log.memory.append((time.perf_counter(), self.streams.memory_allocated()))

    def _computing(self) -> int:
        """FWD / BWD issued and not yet finished on the device (finished ones are dropped)."""
        while self.in_flight and self.streams.done(self.in_flight[0]):
            self.in_flight.popleft()
        return len(self.in_flight)

    def _ready(self, a: Action) -> bool:
        if not all(d in self.available for d in self.needs[a.id]):
            return False
        if a.kind == Kind.LOAD and not all(self.streams.done(d) for d in self.evicts[a.id]):
            self.freeing = True
            return False
        if a.kind.info.stream == "recv" and self.compute and self.compute[0].id < a.id:
            return False  # posted no earlier than its place in the schedule: see "RECV gate" in the module docstring
        if self.carry is not None and self.carry.steps and self.carry.blocks(self.interp, a, a.iteration + self.shift):
            return False
        return (not a.kind.info.is_compute or len(self.in_flight) < RUNAHEAD_COMPUTE
                or self._computing() < RUNAHEAD_COMPUTE)

    def _poll(self) -> bool:
        """Finish what has completed since the last pass: carried steps, polled transfers, host steps."""
        progressed = False
        if self.carry is not None and self.carry.steps:
            done = self.carry.collect(id_stride=self.id_stride, ledger=self.ledger)
            self.log.records += done
            progressed = bool(done)
        for res, (a, (handle, on_done)) in list(self.running.items()):
            if handle.is_completed():
                handle.wait()  # surfaces a failed transfer
                on_done()
                self.streams.mark_end(a.id)
                del self.running[res]
                self._finish(a)
                progressed = True
        for aid, (a, fut) in list(self.on_host.items()):
            if fut.done():
                self.host_times[aid] = fut.result()  # re-raises the step's error
                del self.on_host[aid]
                self._finish(a)
                progressed = True
        return progressed

    def _idle(self, progressed: bool) -> bool:
        """Nothing could be issued this pass: True when the window is done; a schedule that cannot
        progress is an ExecutionError; otherwise wait a little without holding the GIL (which the
        optimizer thread needs)."""
        carried = self.carry is not None and bool(self.carry.steps)
        if not (self.running or self.on_host or self.freeing or self._computing() or carried):
            if not self.queues:
                return True
            raise ExecutionError(_stuck(self.interp.rank, self.queues, self.available, self.by_id))
        if progressed:
            self.idle_since = time.perf_counter()
        elif time.perf_counter() - self.idle_since > STUCK_S:
            unfinished = [*self.running.values(), *self.on_host.values()]
            raise ExecutionError(_stuck(self.interp.rank, self.queues, self.available, self.by_id)
                                 + "; still unfinished: " + ", ".join(f"{a.id} ({a})" for a, _ in unfinished))
        time.sleep(IDLE_SLEEP_S)
        return False

    def _issue(self, a: Action) -> None:
        q = self.queues[a.resource]
        q.popleft()
        if not q:
            del self.queues[a.resource]
        self.log.order[a.resource].append(a.id)
        self.log.issued.append(a.id)
        self.ledger.start(a)
        if a.kind == Kind.OPT_STEP:
            self._issue_host(a)
        else:
            self._issue_device(a)

    def _issue_host(self, a: Action) -> None:
        """An OPT_STEP on the host worker: it waits for the device work the step reads (the gradients'
        download); uploads still reading the layer's host memory are the host state's to wait for."""
        waits = [d for d in a.deps if d in self.by_id]
        fut = self.worker.submit(functools.partial(self.streams.host_wait, waits),
                                 functools.partial(self.interp.dispatch, a, a.iteration + self.shift))
        self.on_host[a.id] = (a, fut)

    def _issue_device(self, a: Action) -> None:
        t_issue = time.perf_counter()
        with self.streams.issuing(a.resource, a.id, (d for d in a.deps if d in self.by_id)):
            started = self.streams.settle(self.interp.dispatch(a, a.iteration + self.shift))
            if started is None:
                self.streams.mark_end(a.id)
        rid = a.id + self.shift * self.id_stride
        self.log.issue.append((rid, t_issue, time.perf_counter()))
        if self.memory:
            got = self.streams.take_peak()
            if got is not None:
                self.log.peaks.append((time.perf_counter(), rid, got[0]))
                self.log.reserved_peak = max(self.log.reserved_peak, got[1])
        if a.kind.info.is_compute:
            self.in_flight.append(a.id)
        if started is None:
            self._finish(a)
        else:
            self.running[a.resource] = (a, started)

    def _close(self) -> RunLog:
        """The window's records (device markers; the host clock for OPT_STEPs) and losses."""
        for aid in self.finished:
            a = self.by_id[aid]
            times = self.host_times.get(aid) or self.streams.times(aid)
            t0, t1 = times if times is not None else (0.0, 0.0)
            self.log.records.append(_record(a, self.shift, self.id_stride, t0, t1))
        self.streams.forget()
        for (step, _m), loss in sorted(self.interp.losses.items()):
            self.log.losses[step] = self.log.losses.get(step, 0.0) + float(loss.item())
        self.interp.losses.clear()
        return self.log


def _record(a: Action, shift: int, id_stride: int, t0: float, t1: float) -> Record:
    """The timeline record of `a` run for step `a.iteration + shift` (ids distinct across windows)."""
    return Record(a.id + shift * id_stride, a.resource, a.kind.value, a.label, a.layer, a.microbatch,
                  a.iteration + shift, t0, t1)


def _stuck(rank: int, queues: dict[str, deque[Action]], done: set[int], by_id: dict[int, Action]) -> str:
    waits = []
    for res, q in sorted(queues.items()):
        a = q[0]
        missing = [d for d in a.deps if d in by_id and d not in done]
        waits.append(f"{res} at {a.id} ({a}) waits for {missing or 'its stream'}")
    return f"rank {rank}: the schedule cannot progress: " + "; ".join(waits)
