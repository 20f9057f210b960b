"""A rank's main thread issuing its actions one at a time (`tinypipe.ir.issueloop`), as a SimPy process.

The engine starts a device action no earlier than its issue began (an OPT_STEP: its submission to the
optimizer thread, by the same loop). Each issue takes the two times given per action id: the loop's
pass before the handler (its polls and checks) and the handler (an eager layer's kernels are launched
in it); 0 where none is given. The loop sees a device action's or an OPT_STEP's end when it next
looks: after the issue it is busy with, or at the end of the IDLE_SLEEP_S pause in which the end fell.

Why: in the eager sync Qwen3-1.7B run on an H200 (2 x 2048, 16 microbatches; trace
1gpu-preset-ab-qwen3-mb2-eager, its `g0.issue` thread) the main thread took a median 2.40 ms to issue a
block's FWD that the device runs in ~1.4 ms, and the device started each action a median 0.14 ms after
its issue began. The compute list head was thus always ready, and a layer's LOAD, next in id order, was
issued only after the FWD before it: each first-microbatch FWD of a layer waited ~1.9 ms for its upload,
where a replay that starts a LOAD once its dependencies end had it done long before. Replayed without
this loop the steady iteration came out 1.77% short; with the handlers' times 1.05% short (between two
issues the loop itself took 0.053 ms on average, 3,090 of its 3,149 passes; without them the replayed
host ran ahead of the device, which filled the runahead and let the LOADs go early); with both, 0.02%.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import simpy

from tinypipe.ir.issueloop import IDLE_SLEEP_S, RUNAHEAD_COMPUTE, IssueRules
from tinypipe.ir.schedule import Action, resource_gpu


class Issuer:
    """One rank's issue loop (module docstring); `begun` / `issued`: action id -> when its issue began / ended."""

    def __init__(self, env: simpy.Environment, actions: Sequence[Action], rules: IssueRules,
                 issue_s: Mapping[int, tuple[float, float]], end_s: Sequence[float]) -> None:
        self.env = env
        self.begun: dict[int, float] = {}
        self.issued: dict[int, float] = {}
        self._actions, self._rules, self._issue_s, self._end_s = actions, rules, issue_s, end_s
        self._waiters: dict[int, simpy.Event] = {}  # action id -> fired when its issue begins
        self._changed: simpy.Event | None = None  # fired at an end while the loop sleeps
        env.process(self._loop())

    def wait(self, aid: int) -> simpy.Event | None:
        """An event fired when action `aid`'s issue begins; None if it has begun."""
        if aid in self.begun:
            return None
        ev = self._waiters.get(aid)
        if ev is None:
            ev = self._waiters[aid] = self.env.event()
        return ev

    def ended(self) -> None:
        """One of the rank's actions has ended: a sleeping loop looks again at the end of its pause."""
        if self._changed is not None and not self._changed.triggered:
            self._changed.succeed()

    def _loop(self) -> Generator[simpy.Event, Any, None]:
        env, acts, rules, end_s = self.env, self._actions, self._rules, self._end_s
        queues = [deque(q) for q in rules.queues]
        compute = next((q for q in queues if acts[q[0]].resource.endswith(".compute")), None)  # the RECV gate's
        in_flight: deque[int] = deque()  # FWD / BWD issued, maybe not finished on the device

        def available(d: int) -> bool:  # a device action once issued; an OPT_STEP once it has finished
            return d in self.issued if resource_gpu(acts[d].resource) is not None else end_s[d] >= 0

        def ready(aid: int) -> bool:
            a = acts[aid]
            if not all(available(d) for d in rules.needs[aid]):
                return False
            if any(end_s[e] < 0 for e in rules.evicts.get(aid, ())):
                return False
            if a.kind.info.stream == "recv" and compute and compute[0] < aid:
                return False
            if a.kind.info.is_compute:
                while in_flight and end_s[in_flight[0]] >= 0:
                    in_flight.popleft()
                return len(in_flight) < RUNAHEAD_COMPUTE
            return True

        while queues:
            heads = [q[0] for q in queues if ready(q[0])]
            if not heads:
                slept = env.now
                self._changed = env.event()
                yield self._changed
                self._changed = None
                pauses = max(1, math.ceil((env.now - slept) / IDLE_SLEEP_S - 1e-9))
                yield env.timeout(max(0.0, slept + pauses * IDLE_SLEEP_S - env.now))
                continue
            aid = min(heads)
            next(q for q in queues if q[0] == aid).popleft()
            queues = [q for q in queues if q]
            loop_s, handler_s = self._issue_s.get(aid, (0.0, 0.0))
            if loop_s > 0:
                yield env.timeout(loop_s)
            self.begun[aid] = env.now
            ev = self._waiters.pop(aid, None)
            if ev is not None:
                ev.succeed()
            if handler_s > 0:
                yield env.timeout(handler_s)
            if acts[aid].kind.info.is_compute:
                in_flight.append(aid)
            self.issued[aid] = env.now
