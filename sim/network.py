"""Copies as fluid flows sharing link bandwidth with max-min fairness, recomputed when a flow starts or ends.

A copy of B bytes over a route with latency α first waits α (the per-copy fixed cost, which uses no
bandwidth), then moves its bytes as a fluid flow. Every capacity it crosses (each directed edge of its
route, plus the host DMA cap for host<->GPU traffic) is shared max-min fairly among the flows crossing
it (progressive filling, Bertsekas & Gallager, *Data Networks*, 2nd ed., §6.5.2). Rates change only
when a flow joins or leaves, so between two such instants every flow moves at a constant rate and the
next completion time is known exactly.

Event scheme: the network keeps one pending completion timer for all its flows. On every change it
advances each active flow's remaining bytes to `now`, recomputes the rates, and schedules one SimPy
timeout at the earliest completion; a timer made stale by a later change carries an old generation
number and does nothing when it fires. So each copy costs O(1) SimPy events (its latency timeout, its
done event, at most one timer at its start and one at its end), not one event per rate change.
A recomputation costs O(rounds x flows x hops) over integer capacity ids; when one flow is alone
(most of the time in compiled schedules) its rate is its path's precomputed bottleneck.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import simpy

# Two completion times closer than this are the same instant: it absorbs float rounding in
# `remaining - rate * dt` (far below any copy latency, which is microseconds).
SAME_INSTANT_S = 1e-9
SHARES_KEPT = 4096  # sets of routes in flight whose max-min rates a Network remembers


class Flow:
    """One copy in flight: the capacity ids it crosses, bytes left, current rate (bytes/s), completion event."""

    __slots__ = ("label", "links", "nbytes", "remaining", "rate", "solo_rate", "done")

    def __init__(self, label: str, links: tuple[int, ...], nbytes: float, done: simpy.Event,
                 solo_rate: float = 0.0) -> None:
        self.label = label
        self.links = links  # indices into the capacity list; an index twice = crossed twice
        self.nbytes = nbytes
        self.remaining = float(nbytes)
        self.rate = 0.0
        self.solo_rate = solo_rate  # its rate when it is the only flow (the common case)
        self.done = done


def max_min_rates(flows: Sequence[Flow], capacity: Sequence[float]) -> None:
    """Set `flow.rate` for every flow to the max-min fair allocation (progressive filling).

    Repeatedly find the capacity whose remaining bandwidth per unfrozen crossing is smallest, give
    that share to each of its unfrozen flows, freeze them and subtract their share from every
    capacity they cross. A flow that crosses a capacity twice (a GPU-to-GPU copy staged through host
    memory crosses the host DMA cap on the way in and on the way out) uses twice its rate of it.
    A flow that crosses no capacity is unconstrained (rate = inf).
    """
    left: dict[int, float] = {}
    crossings: dict[int, int] = {}  # unfrozen crossings per capacity
    unfrozen: list[Flow] = []
    for f in flows:
        if not f.links:
            f.rate = float("inf")
            continue
        unfrozen.append(f)
        for link in f.links:
            if link in crossings:
                crossings[link] += 1
            else:
                crossings[link] = 1
                left[link] = capacity[link]
    while unfrozen:
        bottleneck, share = -1, float("inf")
        for link, n in crossings.items():
            x = left[link] / n
            if x < share:
                bottleneck, share = link, x
        share = max(share, 0.0)
        still: list[Flow] = []
        for f in unfrozen:
            if bottleneck not in f.links:
                still.append(f)
                continue
            f.rate = share
            for link in f.links:
                left[link] -= share
                n = crossings[link] - 1
                if n:
                    crossings[link] = n
                else:
                    del crossings[link]
        unfrozen = still


class Network:
    """Fluid copies over named capacities (bytes/s), e.g. directed edges `"host->rc0"` and `"host.dma"`.

    `copy(nbytes, latency_s, links)` returns an event that succeeds when the copy has finished.
    `bytes_moved[name]` sums the bytes of every copy that crossed that capacity (twice if it crossed twice).
    """

    def __init__(self, env: simpy.Environment, capacity: Mapping[str, float]) -> None:
        for link, c in capacity.items():
            if not c > 0:
                raise ValueError(f"capacity of {link!r} must be > 0 bytes/s, got {c!r}")
        self.env = env
        self.names = list(capacity)
        self.capacity = [float(capacity[k]) for k in self.names]
        self._ids = {k: i for i, k in enumerate(self.names)}
        self._paths: dict[tuple[str, ...], tuple[tuple[int, ...], float]] = {}  # ids, solo rate
        self._moved = [0.0] * len(self.names)
        self.active: list[Flow] = []
        self._last_s = 0.0  # when the remaining bytes of `active` were last brought up to date
        self._generation = 0  # of the one completion timer that is still valid
        # the rates `max_min_rates` gives each set of routes in flight, in `active`'s order (what the rates
        # depend on: the capacities are fixed): a schedule meets the same few sets again and again
        self._shares: dict[tuple[tuple[int, ...], ...], tuple[float, ...]] = {}

    @property
    def bytes_moved(self) -> dict[str, float]:
        return {k: self._moved[i] for i, k in enumerate(self.names) if self._moved[i]}

    def copy(self, nbytes: float, latency_s: float, links: tuple[str, ...], label: str = "") -> simpy.Event:
        """Start a copy now: wait `latency_s`, then move `nbytes` over `links`; the event fires at the end."""
        known = self._paths.get(links)
        if known is None:
            missing = [x for x in links if x not in self._ids]
            if missing:
                raise KeyError(f"copy {label!r} crosses {missing[0]!r}, which has no capacity")
            ids = tuple(self._ids[x] for x in links)
            solo = min((self.capacity[i] / ids.count(i) for i in ids), default=float("inf"))
            known = self._paths[links] = (ids, solo)
        path, solo = known
        moved = self._moved
        for i in path:
            moved[i] += nbytes
        done = self.env.event()
        flow = Flow(label, path, nbytes, done, solo)
        if latency_s > 0:
            self.env.timeout(latency_s).callbacks.append(lambda _e: self._admit(flow))
        else:
            self._admit(flow)
        return done

    def rates(self) -> dict[str, float]:
        """Current rate (bytes/s) of each flow moving bytes, by label (for tests and monitors)."""
        return {f.label: f.rate for f in self.active}

    # ---- internals ---------------------------------------------------------------------------
    def _admit(self, flow: Flow) -> None:
        if flow.remaining <= 0 or not flow.links:
            flow.done.succeed()
            return
        self._advance()
        self.active.append(flow)
        self._reschedule()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last_s
        if dt > 0:
            for f in self.active:
                f.remaining -= f.rate * dt
        self._last_s = now

    def _reschedule(self) -> None:
        self._generation += 1
        if not self.active:
            return
        if len(self.active) == 1:
            f = self.active[0]
            f.rate = f.solo_rate
            dt = f.remaining / f.rate
        else:
            routes = tuple(f.links for f in self.active)
            rates = self._shares.get(routes)
            if rates is None:
                max_min_rates(self.active, self.capacity)
                if len(self._shares) < SHARES_KEPT:
                    self._shares[routes] = tuple(f.rate for f in self.active)
            else:
                for f, r in zip(self.active, rates):
                    f.rate = r
            dt = min((f.remaining / f.rate for f in self.active if f.rate > 0), default=0.0)
        gen = self._generation
        self.env.timeout(max(dt, 0.0)).callbacks.append(lambda _e: self._on_timer(gen))

    def _on_timer(self, generation: int) -> None:
        if generation != self._generation:
            return  # a later change replaced this timer
        self._advance()
        still: list[Flow] = []
        finished: list[Flow] = []
        for f in self.active:
            (finished if f.remaining <= f.rate * SAME_INSTANT_S else still).append(f)
        if not finished:  # cannot happen beyond rounding; guarantee progress anyway
            first = min(still, key=lambda f: f.remaining / f.rate if f.rate > 0 else float("inf"))
            finished = [first]
            still.remove(first)
        self.active = still
        for f in finished:
            f.remaining = 0.0
        self._reschedule()
        for f in finished:
            f.done.succeed()
