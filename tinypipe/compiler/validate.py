"""Static checks of a Schedule; a failure raises ScheduleError with a summary line and the marked grid.

Checks, in order: well-formed actions (resource, stream, ids, ranges); exactly M FWD and M BWD
per layer per iteration, on the layer's GPU; SEND/RECV pairs (`tinypipe.ir.order.pair_halves`) in
the same order on both sides, halves naming the same layer, microbatch, bytes and direction; no
cycle through `tinypipe.ir.order.predecessors` (dependencies, stream order; a pair is one event);
the cross-GPU dependency rule; every FWD/BWD runs while its layer is loaded on its GPU (a
happens-before check: some LOAD before it, that LOAD's EVICT after it); each BWD after its FWD;
memory effects balance (each buffer allocated before it is freed, never twice at once, all
freed by the end). Happens-before uses vector clocks over the resources.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import NoReturn

from tinypipe.common.errors import ScheduleError
from tinypipe.ir.kinds import GPU_STREAMS, HOST_OPTIM, KIND_STREAM, Kind
from tinypipe.ir.order import UnpairedError, pair_halves, predecessors, sender_receiver
from tinypipe.ir.schedule import Schedule, gpu_resource, grid, resource_gpu


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError at the first rule the schedule breaks; return None when it is valid."""
    _Checker(schedule).run()


class _Checker:
    def __init__(self, s: Schedule) -> None:
        self.s = s
        self.acts = s.actions
        self.grad_clip = s.grad_clip
        self.n = len(s.actions)
        self.owner: dict[int, int] = {}
        self.partner: dict[int, int] = {}

    # ---- reporting -------------------------------------------------------------------------------
    def fail(self, summary: str, mark: int | None = None, *others: int) -> NoReturn:
        s = self.s
        gpus: list[int] = []
        host = False
        for aid in ((mark,) if mark is not None else ()) + others:
            g = resource_gpu(self.acts[aid].resource)
            if g is None:
                host = True
            elif g not in gpus and 0 <= g < s.num_gpus:
                gpus.append(g)
        res: tuple[str, ...] | None = None
        if gpus or host:
            known = set(s.resources)
            res = tuple(r for g in sorted(gpus) for r in (gpu_resource(g, st) for st in GPU_STREAMS) if r in known)
            res += (HOST_OPTIM,) if host else ()
        if mark is not None and self.acts[mark].resource not in s.resources:
            mark = None
        raise ScheduleError(f"{summary}\n{grid(s, mark=mark, resources=res)}")

    def name(self, aid: int) -> str:
        return f"action {aid} ({self.acts[aid]})"

    # ---- checks ------------------------------------------------------------------------------------
    def run(self) -> None:
        self.structure()
        self.counts()
        self.pairs()
        self.order()
        self.cross_gpu()
        self.clocks()
        self.loaded()
        self.fwd_before_bwd()
        self.memory()

    def structure(self) -> None:
        s = self.s
        layers = [x for p in s.pack_layers for x in p]
        if layers != list(range(s.num_layers)) or len(s.pack_gpu) != len(s.pack_layers):
            self.fail(f"bad packs: pack_layers must list layers 0..{s.num_layers - 1} once, in order, "
                      f"with one GPU per pack (got {len(s.pack_layers)} packs, {len(s.pack_gpu)} GPUs)")
        bad_gpu = [g for g in s.pack_gpu if not 0 <= g < s.num_gpus]
        if bad_gpu:
            self.fail(f"bad packs: pack mapped to GPU {bad_gpu[0]}, but the schedule has {s.num_gpus} GPUs")
        for p, lays in enumerate(s.pack_layers):
            for x in lays:
                self.owner[x] = s.pack_gpu[p]
        known = set(s.resources)
        for a in self.acts:
            where = self.name(a.id)
            if a.resource not in known:
                self.fail(f"{where}: unknown resource {a.resource!r}")
            stream = "optim" if a.resource == HOST_OPTIM else a.resource.split(".", 1)[1]
            if KIND_STREAM[a.kind] != stream:
                self.fail(f"{where}: {a.kind.value} runs on the {KIND_STREAM[a.kind]} stream, not {stream}", a.id)
            for d in a.deps:
                if not 0 <= d < self.n or d == a.id:
                    self.fail(f"{where}: dependency {d} is not another action of the schedule", a.id)
            if not 0 <= a.layer < s.num_layers:
                self.fail(f"{where}: layer {a.layer} is not a layer of the schedule (0..{s.num_layers - 1})",
                          a.id)
            if not 0 <= a.iteration < s.iterations:
                self.fail(f"{where}: iteration {a.iteration} outside 0..{s.iterations - 1}", a.id)
            if a.kind.info.per_microbatch and (a.microbatch is None or not 0 <= a.microbatch < s.microbatches):
                self.fail(f"{where}: microbatch {a.microbatch} outside 0..{s.microbatches - 1}", a.id)
            if a.kind.info.is_half:
                g = resource_gpu(a.resource)
                if a.peer is None or a.peer == g or not 0 <= a.peer < s.num_gpus:
                    self.fail(f"{where}: {a.kind.value} needs a peer GPU other than its own, got {a.peer}", a.id)
            elif a.kind.info.stream != "optim" and resource_gpu(a.resource) != self.owner[a.layer]:
                self.fail(f"{where}: layer {a.layer} belongs to g{self.owner[a.layer]}, not "
                          f"{a.resource.split('.')[0]}", a.id)

    def counts(self) -> None:
        s = self.s
        m = s.microbatches
        seen: dict[tuple[Kind, int, int], list[int]] = defaultdict(lambda: [0] * m)
        first: dict[tuple[Kind, int, int, int], int] = {}
        for a in self.acts:
            if a.kind is Kind.FWD or a.kind is Kind.BWD:
                assert a.microbatch is not None
                seen[a.kind, a.layer, a.iteration][a.microbatch] += 1
                first.setdefault((a.kind, a.layer, a.iteration, a.microbatch), a.id)
        for it in range(s.iterations):
            for layer in range(s.num_layers):
                for kind in (Kind.FWD, Kind.BWD):
                    got = seen.get((kind, layer, it), [0] * m)
                    for mb, k in enumerate(got):
                        if k != 1:
                            self.fail(f"wrong work count: {k} {kind.value} of layer {layer} microbatch {mb} in "
                                      f"iteration {it}; every iteration has exactly {m} {kind.value} per layer, "
                                      "one per microbatch", first.get((kind, layer, it, mb)))

    def pairs(self) -> None:
        try:
            self.partner = pair_halves(self.acts)
        except UnpairedError as exc:
            self.fail(str(exc), exc.action)
        count: dict[tuple[int, int], int] = defaultdict(int)
        for a in self.acts:
            if a.id not in self.partner or a.kind.info.stream != "send":
                continue
            key = sender_receiver(a)
            k = count[key]
            count[key] += 1
            b = self.acts[self.partner[a.id]]
            if (a.layer, a.microbatch, a.iteration, a.nbytes, a.kind.info.direction) != (
                    b.layer, b.microbatch, b.iteration, b.nbytes, b.kind.info.direction):
                self.fail(f"SEND/RECV out of order: pair {k} from g{key[0]} to g{key[1]} joins "
                          f"{self.name(a.id)} with {self.name(b.id)}; the halves must name the same layer, "
                          "microbatch, iteration, bytes and direction, in the same order on both sides", a.id, b.id)

    def order(self) -> None:
        """Kahn's algorithm over merged pairs, smallest id first; a cycle is reported with its path."""
        n, acts, partner = self.n, self.acts, self.partner
        rep = list(range(n))
        for x, y in partner.items():
            rep[x] = min(x, y)
        before = predecessors(acts, partner=partner)  # a pair's halves: both halves' predecessors
        preds: list[list[int]] = [[] for _ in range(n)]
        succs: list[list[int]] = [[] for _ in range(n)]
        indeg = [0] * n
        for r in range(n):
            if rep[r] != r:
                continue
            ps = {rep[p] for p in before[r]} - {r}
            preds[r] = sorted(ps)
            indeg[r] = len(ps)
            for p in ps:
                succs[p].append(r)
        heap = [r for r in range(n) if rep[r] == r and indeg[r] == 0]
        heapq.heapify(heap)
        topo: list[int] = []
        while heap:
            r = heapq.heappop(heap)
            topo.append(r)
            for q in succs[r]:
                indeg[q] -= 1
                if indeg[q] == 0:
                    heapq.heappush(heap, q)
        nodes = sum(1 for r in range(n) if rep[r] == r)
        if len(topo) < nodes:
            left = {r for r in range(n) if rep[r] == r and indeg[r] > 0}
            r = min(left)
            path: list[int] = []
            index: dict[int, int] = {}
            while r not in index:  # walk back through unfinished predecessors until one repeats
                index[r] = len(path)
                path.append(r)
                r = next(p for p in preds[r] if p in left)
            cycle = path[index[r]:][::-1] + [r]
            shown = " -> ".join(f"{c} ({acts[c]})" for c in cycle[:8]) + (" -> ..." if len(cycle) > 8 else "")
            self.fail(f"dependency cycle (deps, stream order and SEND/RECV pairs): {shown}", r, *cycle[1:3])
        self.rep = rep
        self.preds = preds
        self.topo = topo
        self.rank = [0] * n
        for k, r in enumerate(topo):
            self.rank[r] = k
        for x in range(n):
            self.rank[x] = self.rank[rep[x]]
        self.linear = sorted(range(n), key=lambda x: (self.rank[x], x))  # one valid execution order

    def cross_gpu(self) -> None:
        for a in self.acts:
            g = resource_gpu(a.resource)
            for d in a.deps:
                b = self.acts[d]
                h = resource_gpu(b.resource)
                if g is not None:
                    if h == g or (h is None and b.kind is Kind.OPT_STEP and self.owner.get(b.layer) == g):
                        continue
                    if self.grad_clip and a.kind is Kind.ADAPT_STEP and b.kind is Kind.BWD:
                        continue  # LoRA's global-norm barrier: the backend meets it with an all-reduce
                else:
                    own = self.owner.get(a.layer)
                    if h == own or (h is None and self.owner.get(b.layer) == own):
                        continue
                    if self.grad_clip and a.kind is Kind.OPT_STEP and b.kind is Kind.GRAD_OUT:
                        continue  # the global-norm barrier: the backend meets it with an all-reduce
                where = "the host" if h is None else f"g{h}"
                self.fail(f"cross-GPU dependency: {self.name(a.id)} depends on {self.name(d)} on {where}; "
                          "GPUs exchange data only through SEND/RECV pairs (and a layer's OPT_STEP only with "
                          "its own GPU)", a.id, d)

    def clocks(self) -> None:
        """Vector clock per action: for each resource, the last position there that happened before."""
        res = {r: k for k, r in enumerate(self.s.resources)}
        width = len(res)
        pos = [0] * self.n
        rix = [0] * self.n
        count = [0] * width
        for a in self.acts:
            k = res[a.resource]
            rix[a.id] = k
            pos[a.id] = count[k]
            count[k] += 1
        vc: list[list[int]] = [[]] * self.n
        members: dict[int, list[int]] = defaultdict(list)
        for x, y in self.partner.items():
            members[min(x, y)].append(x)
        for r in self.topo:
            row = [-1] * width
            for p in self.preds[r]:
                row = list(map(max, row, vc[p]))
            for x in members.get(r, (r,)):
                row[rix[x]] = pos[x]
            vc[r] = row
        for x in range(self.n):
            vc[x] = vc[self.rep[x]]
        self.vc, self.pos, self.rix = vc, pos, rix

    def hb(self, a: int, b: int) -> bool:
        """Action a finishes before action b starts, in every execution."""
        if self.rep[a] == self.rep[b]:
            return False
        return self.vc[b][self.rix[a]] >= self.pos[a]

    def loaded(self) -> None:
        events: dict[tuple[str, int], list[int]] = defaultdict(list)
        for aid in self.linear:
            a = self.acts[aid]
            if a.kind in (Kind.LOAD, Kind.EVICT, Kind.FWD, Kind.BWD):
                events[a.resource.split(".")[0], a.layer].append(aid)
        for (dev, layer), evs in events.items():
            kinds = [self.acts[e].kind for e in evs]
            next_evict: list[int | None] = [None] * len(evs)
            nxt: int | None = None
            for k in range(len(evs) - 1, -1, -1):
                next_evict[k] = nxt
                if kinds[k] is Kind.EVICT:
                    nxt = evs[k]
            ld: int | None = None
            ld_at = -1
            for k, x in enumerate(evs):
                if kinds[k] is Kind.LOAD:
                    ld, ld_at = x, k
                    continue
                if kinds[k] is Kind.EVICT:
                    continue
                if ld is None or not self.hb(ld, x):
                    near = "no LOAD of it there comes first" if ld is None else "nearest " + self.name(ld)
                    self.fail(f"not loaded: {self.name(x)} may run before a LOAD of layer {layer} on {dev} "
                              f"finishes ({near}); make it depend on that LOAD", x, *(() if ld is None else (ld,)))
                ev = next_evict[ld_at]
                if ev is not None and not self.hb(x, ev):
                    self.fail(f"not loaded: {self.name(ev)} may run before {self.name(x)} finishes; a layer's "
                              "EVICT must follow its last use", x, ev)

    def fwd_before_bwd(self) -> None:
        fwd: dict[tuple[int | None, int | None, int], int] = {}
        for a in self.acts:
            if a.kind is Kind.FWD:
                fwd[a.layer, a.microbatch, a.iteration] = a.id
        for a in self.acts:
            if a.kind is Kind.BWD:
                f = fwd[a.layer, a.microbatch, a.iteration]
                if not self.hb(f, a.id):
                    self.fail(f"BWD before FWD: {self.name(a.id)} is not ordered after {self.name(f)}", a.id, f)

    def memory(self) -> None:
        live: dict[tuple[str, str], tuple[int, int]] = {}
        freed: dict[tuple[str, str], int] = {}
        order = self.linear
        k = 0
        while k < len(order):  # a pair's halves share a rank: both start, then both end
            group = [order[k]]
            while k + len(group) < len(order) and self.rank[order[k + len(group)]] == self.rank[order[k]]:
                group.append(order[k + len(group)])
            k += len(group)
            for x in group:
                for m in self.acts[x].allocs:
                    key = (m.device, m.buffer)
                    if key in live:
                        self.fail(f"memory does not balance: {self.name(x)} allocates {m.device}:{m.buffer} while "
                                  f"{self.name(live[key][0])} still holds it", x, live[key][0])
                    prev = freed.get(key)
                    if prev is not None and not self.hb(prev, x):
                        self.fail(f"memory does not balance: {self.name(x)} allocates {m.device}:{m.buffer} and may "
                                  f"run before {self.name(prev)} frees the previous one", x, prev)
                    live[key] = (x, m.nbytes)
            for x in group:
                for m in self.acts[x].frees:
                    key = (m.device, m.buffer)
                    got = live.pop(key, None)
                    if got is None:
                        self.fail(f"memory does not balance: {self.name(x)} frees {m.device}:{m.buffer}, which is "
                                  "not allocated", x)
                    if got[1] != m.nbytes:
                        self.fail(f"memory does not balance: {self.name(x)} frees {m.nbytes} B of {m.device}:"
                                  f"{m.buffer}, but {self.name(got[0])} allocated {got[1]} B", x, got[0])
                    if got[0] != x and not self.hb(got[0], x):
                        self.fail(f"memory does not balance: {self.name(x)} frees {m.device}:{m.buffer} and may run "
                                  f"before {self.name(got[0])} allocates it", x, got[0])
                    freed[key] = x
        if live:
            (dev, buf), (x, nbytes) = min(live.items(), key=lambda kv: kv[1][0])
            self.fail(f"memory does not balance: {dev}:{buf} ({nbytes} B) allocated by {self.name(x)} is never "
                      f"freed ({len(live)} buffer{'s' if len(live) != 1 else ''} left at the end)", x)
