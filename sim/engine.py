"""The simulator: one SimPy process per schedule lane runs its actions in order (stream + event semantics).

An action starts when its predecessors have finished (`tinypipe.ir.order`: the previous action on its
lane and all its dependencies; the deadlock report lists those still running). Each kind is timed by
its cost class in `tinypipe.ir.kinds.KINDS` (the rules: sim/durations.py; a class with no rule is an
error), as docs/schedule-contract.md says:
- compute (FWD / BWD): the trace's times (`KindProfile.compute_s`; a recomputed layer whose kind has
  loop times, `tinypipe.describe.looptimes`, takes those);
- EVICT: no time;
- OPT_STEP (on `host.optim`): `hostmem.optimizer_step_s`, the trace's step of the layer's kind measured
  in a run's conditions, else the host layout's rate;
- copies (uploads, downloads, the SEND / RECV halves): fluid flows over the hardware route
  (sim/network.py). A SEND and its RECV (`tinypipe.ir.order.pair_halves`) rendezvous: the copy starts
  when both halves are ready and both end with it; each half's record starts when its own stream
  reached it, as a CUDA event recorded before it would.
Memory effects go through the ledgers (sim/memory.py).

Loop times: a FWD / BWD with loop times costs its `*_beside_optimizer_s` time when an OPT_STEP is
running on any host optimizer lane at the instant it starts, else its alone time (both the larger of
the device's time and the main thread's issue time, `LoopTimes.compute_s`), and starts no earlier than
the loop's issue gap (`KindProfile.issue_gap_s`) after the previous FWD / BWD on its lane. A start-time
rule is enough: the actions take milliseconds and the steps tens of milliseconds.

Steps by phase: an OPT_STEP whose trace measured the step by what its rank's main thread does meanwhile
(`hostmem.optimizer_step_phases_s`: alone, beside FWDs, beside BWDs) runs as a fluid with one step of
work at the rate 1 / (the phase's time), the phase being that of its rank's compute lane (FWD or BWD
while the lane runs one, idle while it waits); at each change of phase the running steps carry their
remaining work on at the new rate. Otherwise an OPT_STEP takes `hostmem.optimizer_step_s` whatever runs.

Lanes: one per resource of `tinypipe.ir.order.run_lanes`, except the host optimizer, where every rank
runs its own layers' OPT_STEPs on a lane of its own, as the backend does, so ranks' steps overlap.
Each step takes the time measured for one rank at its thread count; where the hardware gives the host's DRAM
bandwidth, steps not measured by phase share it with each other and with the copies (sim/durations.py).

Replay (`tinypipe replay`) swaps in measured times: `durations` gives actions a fixed duration instead
of their cost (a SEND / RECV half: its time after both halves are ready), `lanes` the lists to run
instead of `run_lanes`' (e.g. under the CPU backend, one lane per rank's thread), and `issue` (per
action: the issue loop's pass before it and its handler, in seconds) runs each rank's host issue loop
(sim/issuer.py): an action of the rank starts no earlier than its issue began. docs/architecture.md
places the simulator in the house; docs/fidelity.md says how its predictions compare with runs.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import simpy

from tinypipe.common.errors import InputError, ScheduleError
from tinypipe.common.gcpause import collector_paused
from tinypipe.describe.hardware import HOST, Hardware
from tinypipe.describe.model import ModelSpec
from tinypipe.describe.optimprofile import Phase, StepPhases
from tinypipe.describe.trace import ProfileTrace
from tinypipe.ir.issueloop import issue_rules
from tinypipe.ir.kinds import Cost, Direction, Kind
from tinypipe.ir.order import pair_halves, predecessors, run_lanes
from tinypipe.ir.schedule import Schedule, rank_actions, resource_gpu
from tinypipe.ir.timeline import Record, Timeline

from .durations import COPY, LOOP, OPT, PAIR, PHASED, TIMED, action_costs, link_capacities
from .issuer import Issuer
from .memory import Memory
from .network import Network
from .result import SimResult, build_result

_DONE = 1e-9  # work left (of one step) below which a phased OPT_STEP has ended: rounding of the fluid's sums


class Engine:
    """One simulation run of one schedule; `run()` returns the Timeline."""

    def __init__(self, schedule: Schedule, model: ModelSpec, hardware: Hardware, trace: ProfileTrace,
                 memory: Memory, *, durations: Mapping[int, float] | None = None,
                 lanes: Mapping[str, Sequence[int]] | None = None,
                 issue: Mapping[int, tuple[float, float]] | None = None) -> None:
        self.schedule = schedule
        self.env = simpy.Environment()
        self.memory = memory
        self.partner = pair_halves(schedule.actions)
        self.lanes: Mapping[str, Sequence[int]] = run_lanes(schedule) if lanes is None else lanes
        n = len(schedule.actions)
        self.start_s = [0.0] * n
        self.end_s = [-1.0] * n  # -1: not finished
        self._waiters: dict[int, simpy.Event] = {}  # action id -> event fired when it ends
        self._rendezvous: dict[int, simpy.Event] = {}  # half that arrived first -> its wake-up event
        self._mode, self._cost, lanes_cap = action_costs(schedule, model, hardware, trace, self.partner)
        self.network = Network(self.env, {**link_capacities(hardware), **lanes_cap})
        self._steps_running = 0  # OPT_STEPs running now, on any optimizer lane (module docstring)
        # phases (module docstring): each rank's compute phase, the event its phased steps wait on for the
        # next change (made when one waits), and per action the phase it sets (FWD / BWD of a GPU whose
        # rank has phased steps; IDLE: none)
        self._phase: dict[int, Phase] = {}
        self._phase_change: dict[int, simpy.Event] = {}
        self._sets_phase: list[Phase] = [Phase.IDLE] * n
        self._is_compute = [a.kind.info.is_compute for a in schedule.actions]  # FWD / BWD (issue gaps)
        self._fixed: dict[int, float] = {}  # SEND / RECV half -> measured duration after the rendezvous (replay)
        for aid, d in (durations or {}).items():
            if not 0 <= aid < n or not d >= 0:
                raise InputError(f"durations: action {aid}: {d!r} s; expected an action id in 0..{n - 1} "
                                 "and a duration >= 0")
            if self._mode[aid] == PAIR:
                self._fixed[aid] = float(d)
            else:  # any other action simply takes its measured time (an OPT_STEP still counts as running)
                self._mode[aid] = OPT if self._mode[aid] in (OPT, PHASED) else TIMED
                self._cost[aid] = float(d)
        phased = {self._cost[i][1] for i, m in enumerate(self._mode) if m == PHASED}
        for a in schedule.actions if phased else ():
            g = resource_gpu(a.resource)
            if g in phased and a.kind.info.cost is Cost.COMPUTE and self._cost[a.id] != 0:
                self._sets_phase[a.id] = Phase.FWD if a.kind.info.direction is Direction.FORWARD else Phase.BWD
        self._phase = {g: Phase.IDLE for g in phased}
        # the loop that issues each action (`issue` given; else None, and no action has one)
        self._issuer: list[Issuer | None] | None = None
        if issue is not None:
            issuers: list[Issuer | None] = [None] * n
            for g in range(schedule.num_gpus):
                acts = rank_actions(schedule, g)
                if acts:
                    it = Issuer(self.env, schedule.actions, issue_rules(acts), issue, self.end_s)
                    for a in acts:
                        issuers[a.id] = it
            self._issuer = issuers
        for ids in self.lanes.values():
            if ids:
                self.env.process(self._run(ids))

    def run(self) -> Timeline:
        self.env.run()
        stuck = [i for i, e in enumerate(self.end_s) if e < 0]
        if stuck:
            raise ScheduleError(self._deadlock_message(stuck))
        labels: dict[tuple[Kind, int | None, int | None], tuple[str, str]] = {}
        records = []
        for a, t0, t1 in zip(self.schedule.actions, self.start_s, self.end_s):
            key = (a.kind, a.layer, a.microbatch)
            kl = labels.get(key)
            if kl is None:
                kl = labels[key] = (a.kind.value, a.label)
            records.append(Record(a.id, a.resource, kl[0], kl[1], a.layer, a.microbatch, a.iteration, t0, t1))
        return Timeline(tuple(records), self.memory.samples(), "sim", dict(self.schedule.meta))

    @property
    def events(self) -> int:
        """SimPy events scheduled so far (SimPy numbers them from 0; read after the run). 0 if unknown."""
        eid = getattr(self.env, "_eid", None)
        return int(next(eid)) if eid is not None else 0

    def _run(self, ids: Sequence[int]) -> Generator[simpy.Event, Any, None]:
        env, actions, end_s, start_s = self.env, self.schedule.actions, self.end_s, self.start_s
        mode, cost, waiters, memory, net = self._mode, self._cost, self._waiters, self.memory, self.network
        sets_phase, is_compute, issuers = self._sets_phase, self._is_compute, self._issuer
        timeout, event = env.timeout, env.event
        lane_gpu = None  # the GPU whose phase this lane sets (its compute actions'), once it has run one
        compute_end = -1.0  # when the lane's last FWD / BWD ended (issue gaps)
        issuer = None
        for aid in ids:  # one process per lane runs it in order: the predecessor on the stream is done
            a = actions[aid]
            for d in a.deps:
                if end_s[d] < 0:
                    if lane_gpu is not None:
                        self._set_phase(lane_gpu, Phase.IDLE)  # the lane waits
                    ev = waiters.get(d)
                    if ev is None:
                        ev = waiters[d] = event()
                    yield ev
            if issuers is not None:
                issuer = issuers[aid]
            if issuer is not None:
                ev = issuer.wait(aid)
                if ev is not None:
                    if lane_gpu is not None:
                        self._set_phase(lane_gpu, Phase.IDLE)  # the lane waits for the host
                    yield ev  # the host has not begun to issue it
            m = mode[aid]
            beside = 0
            if m == LOOP:  # (alone, beside, gap alone, gap beside): picked now
                beside = 1 if self._steps_running else 0
                wait = compute_end + cost[aid][2 + beside] - env.now
                if wait > 0 and compute_end >= 0:
                    yield timeout(wait)  # the main thread issuing it
            if sets_phase[aid]:
                lane_gpu = resource_gpu(a.resource)
                assert lane_gpu is not None
                self._set_phase(lane_gpu, sets_phase[aid])
            t0 = env.now
            start_s[aid] = t0
            if a.allocs:
                memory.alloc(a, t0)
            if m == TIMED:
                dur = cost[aid]
                if dur > 0:
                    yield timeout(dur)
            elif m == OPT:
                yield from self._opt_step(cost[aid])
            elif m == PHASED:
                yield from self._phased_step(*cost[aid])
            elif m == LOOP:
                yield timeout(cost[aid][beside])
            elif m == COPY:
                nbytes, lat, links = cost[aid]
                yield net.copy(nbytes, lat, links)
            else:
                yield from self._half(aid)
            t1 = env.now
            if is_compute[aid]:
                compute_end = t1
            if a.frees:
                memory.free(a, t1)
            end_s[aid] = t1
            ev = waiters.pop(aid, None)
            if ev is not None:
                ev.succeed()
            if issuer is not None:
                issuer.ended()
        if lane_gpu is not None:
            self._set_phase(lane_gpu, Phase.IDLE)  # the lane has nothing left

    def _opt_step(self, c: Any) -> Generator[simpy.Event, Any, None]:
        """An OPT_STEP of `c` seconds, or a flow over the host DRAM (a tuple, sim/durations.py), counted as running."""
        flow = isinstance(c, tuple)
        if flow or c > 0:
            self._steps_running += 1
            yield self.network.copy(c[1], 0.0, c[2]) if flow else self.env.timeout(c)
            self._steps_running -= 1

    def _half(self, aid: int) -> Generator[simpy.Event, Any, None]:
        """A SEND / RECV half: the first here waits for the other, which starts the copy both end with (module
        docstring); a half with a measured duration takes it after the rendezvous (replay)."""
        fixed = self._fixed.get(aid)
        other = self._rendezvous.pop(self.partner[aid], None)
        if other is None:  # first half here: wait for the other to start the copy
            mine = self._rendezvous[aid] = self.env.event()
            done = yield mine
        else:  # both here: the copy starts (unless both halves' durations are given)
            if fixed is not None and self.partner[aid] in self._fixed:
                done = self.env.event().succeed()
            else:
                nbytes, lat, links = self._cost[aid]
                done = self.network.copy(nbytes, lat, links)
            other.succeed(done)
        yield done if fixed is None else self.env.timeout(fixed)

    def _set_phase(self, gpu: int, phase: Phase) -> None:
        """Rank `gpu`'s compute lane now runs `phase`; its phased steps, if any wait, carry on at the new rate."""
        if self._phase[gpu] != phase:
            self._phase[gpu] = phase
            ev = self._phase_change.pop(gpu, None)
            if ev is not None:
                ev.succeed()

    def _phased_step(self, times: StepPhases, gpu: int) -> Generator[simpy.Event, Any, None]:
        """One OPT_STEP of rank `gpu` as a fluid (module docstring): one step of work at 1 / times[phase]."""
        env = self.env
        self._steps_running += 1
        left = 1.0  # of the step's work
        while left > _DONE:
            t = times[self._phase[gpu]]
            if t <= 0:
                break
            since = env.now
            change = self._phase_change.get(gpu)
            if change is None:
                change = self._phase_change[gpu] = env.event()
            done = env.timeout(left * t)
            yield done | change
            if done.processed or not change.triggered:
                break
            left -= (env.now - since) / t
        self._steps_running -= 1

    def _deadlock_message(self, stuck: list[int]) -> str:
        acts = self.schedule.actions
        before = predecessors(acts, lanes=self.lanes)
        lines = []
        for ids in self.schedule.by_resource().values():
            first = next((i for i in ids if self.end_s[i] < 0), None)
            if first is None:
                continue
            a = acts[first]
            waits = [f"`{acts[d]}` (action {d})" for d in before[first] if self.end_s[d] < 0]
            if first in self.partner and not waits:
                p = self.partner[first]
                waits = [f"its other half `{acts[p]}` (action {p})"]
            lines.append(f"`{a}` (action {first}) waits for " + (", ".join(waits) or "its predecessor"))
        return (f"schedule deadlocks: {len(stuck)} of {len(acts)} actions never run; "
                + "; ".join(lines[:8]) + ("; ..." if len(lines) > 8 else ""))


def simulate(schedule: Schedule, model: ModelSpec, hardware: Hardware, trace: ProfileTrace, *,
             gpu_mem_bytes: int | Sequence[int] | None = None, host_mem_bytes: int | None = None,
             on_capacity: str = "raise", durations: Mapping[int, float] | None = None,
             lanes: Mapping[str, Sequence[int]] | None = None,
             issue: Mapping[int, tuple[float, float]] | None = None) -> SimResult:
    """Simulate `schedule` on `hardware` with compute times from `trace`; return its SimResult.

    Capacities are the hardware's memory sizes unless `gpu_mem_bytes` (one value for every GPU, or
    one per GPU) or `host_mem_bytes` replace them (e.g. a 24 GiB limit on an 80 GiB card).
    `on_capacity="raise"` raises CapacityError at the first allocation that does not fit;
    `"record"` lets the run finish and returns `fits=False` with the first violation.
    `durations` (action id -> s) and `lanes` (lane -> ids in order) are replay's: see the module docstring.
    """
    if on_capacity not in ("raise", "record"):
        raise InputError(f"on_capacity must be 'raise' or 'record', got {on_capacity!r}")
    n = schedule.num_gpus
    if n > len(hardware.gpus):
        raise InputError(f"schedule uses {n} GPUs but hardware {hardware.name!r} has {len(hardware.gpus)}")
    if gpu_mem_bytes is None or isinstance(gpu_mem_bytes, int):
        caps: list[int | None] = [gpu_mem_bytes] * n
    else:
        caps = list(gpu_mem_bytes)
        if len(caps) != n:
            raise InputError(f"gpu_mem_bytes lists {len(caps)} GPUs; the schedule uses {n}")
    # the ledger's room: the memory or the cap, less what the allocator keeps reserved (`GPU.usable_bytes`)
    capacity = {f"g{g}": hardware.gpus[g].usable_bytes(caps[g]) for g in range(n)}
    capacity[HOST] = hardware.host.memory_bytes if host_mem_bytes is None else host_mem_bytes
    static = {d: schedule.static(d) for d in capacity}
    with collector_paused():  # events, records and samples by the ten thousand, mostly kept (common/gcpause.py)
        wall0 = time.perf_counter()
        memory = Memory(capacity, static, on_capacity=on_capacity)
        engine = Engine(schedule, model, hardware, trace, memory, durations=durations, lanes=lanes, issue=issue)
        timeline = engine.run()
        peaks, violation = memory.peaks(), memory.violation
        if schedule.optimizer.is_async and durations is None:
            slow = slow_host_memory(schedule, model, hardware, trace, capacity, static, on_capacity, lanes, issue,
                                    timeline.end_s)
            peaks = {d: max(b, slow.peaks().get(d, 0)) if d != HOST else b for d, b in peaks.items()}
            violation = violation or slow.violation
        wall_s = time.perf_counter() - wall0
        return build_result(schedule, timeline, partner=engine.partner, lanes=engine.lanes, params=model.params,
                            capacity_bytes=capacity, peak_bytes=peaks,
                            link_bytes=dict(engine.network.bytes_moved), violation=violation,
                            events=engine.events, wall_s=wall_s)


def slow_host_memory(schedule: Schedule, model: ModelSpec, hardware: Hardware, trace: ProfileTrace,
                     capacity: dict[str, int], static: dict[str, int], on_capacity: str,
                     lanes: Mapping[str, Sequence[int]] | None, issue: Mapping[int, tuple[float, float]] | None,
                     makespan_s: float) -> Memory:
    """The ledgers of `schedule` run with every OPT_STEP slower than the whole run (`makespan_s`).

    Under the async optimizer the GPU runs on while the host steps: a layer's gradient stays on its GPU
    until its GRAD_OUT, which waits for the layer's step of the iteration before, so how many gradients
    pile up on the GPU depends on how fast the host steps. A run's ledger reached 18.28 GiB where the
    simulator at the profile's optimizer rate said 12.98 (12-layer Llama-3.1-8B, async compact, H200,
    issue 26: a host slower than its profile). The GPU peak predicted for async is the larger of the
    two runs', which the run's ledger stays under whatever the host's speed (a sync run's GPU work waits
    for its steps, so its peak does not grow with a slow host; tests/backends/test_ledger_agreement.py).
    """
    slow = Memory(capacity, static, on_capacity=on_capacity)
    step_s = max(1.0, 2 * makespan_s)
    durations = {a.id: step_s for a in schedule.actions if a.kind is Kind.OPT_STEP}
    Engine(schedule, model, hardware, trace, slow, durations=durations, lanes=lanes, issue=issue).run()
    return slow
